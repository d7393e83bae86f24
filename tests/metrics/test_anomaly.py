"""Anomaly detectors: each fires on an injected anomaly (right kind, step, rank) and stays quiet on noise."""
import json
import math
import random
import socket

import pytest

from labkit.metrics.anomaly import (
    KINDS,
    Alert,
    AnomalyMonitor,
    AnomalyThresholds,
    diagnosis_request,
    scan,
    scan_run,
)

WORLD, TOKENS, STEP_S, MEM = 4, 8192, 0.048, 1.2e9


def clean_run(steps=500, seed=0, noise=0.05, world=WORLD) -> list[dict]:
    """A healthy run: every measurement with ``noise`` relative gaussian noise, loss slowly decreasing."""
    rng = random.Random(seed)

    def jitter(x):
        return x * (1 + rng.gauss(0, noise))

    events = [{"type": "start", "world_size": world}]
    for s in range(steps):
        ranks = [jitter(STEP_S) for _ in range(world)]
        step_time = ranks[0]
        events.append({"type": "step", "step": s, "loss": jitter(1.5 + 2.0 * math.exp(-s / 150)),
                       "tokens_per_s": TOKENS / max(ranks), "step_time_s": step_time,
                       "comm_frac": jitter(0.2), "mfu": jitter(0.3),
                       "max_mem_bytes": int(MEM * min(1.0, 0.5 + s / 6)),  # the peak settles during warm-up
                       "rank_step_time_s": ranks})
    return events


def steps_of(events):
    return {e["step"]: e for e in events if e.get("type") == "step"}


def only(alerts, kind):
    return [a for a in alerts if a.kind == kind]


def test_clean_noisy_series_has_no_false_alarms():
    total_steps = total_alerts = 0
    for seed in range(5):
        events = clean_run(seed=seed)
        alerts = scan(events)
        total_steps += len(events) - 1
        total_alerts += len(alerts)
        assert alerts == [], [a.message for a in alerts]
    rate = total_alerts / total_steps
    print(f"false-alarm rate on {total_steps} clean steps (5% gaussian noise, 5 seeds): {rate:.4f}")
    assert rate == 0


def test_throughput_drop_fires_once_for_a_sustained_slowdown():
    events = clean_run()
    by_step = steps_of(events)
    for s in range(200, 260):
        by_step[s]["tokens_per_s"] /= 2
    alerts = only(scan(events), "throughput_drop")
    assert [(a.step, a.rank) for a in alerts] == [(201, None)]  # the median of 3 steps: 2 slow ones suffice
    assert alerts[0].value < alerts[0].threshold < alerts[0].baseline
    assert "tokens/s" in alerts[0].message and alerts[0].message.startswith("step 201:")


def test_one_slow_step_is_a_spike_not_a_drop():
    events = clean_run()
    steps_of(events)[150]["step_time_s"] *= 4
    steps_of(events)[150]["tokens_per_s"] /= 4
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("step_time_spike", 150)]
    assert "4." in alerts[0].message and "× the" in alerts[0].message


def test_straggler_names_the_rank_after_m_consecutive_steps():
    events = clean_run()
    for s in range(300, 320):
        steps_of(events)[s]["rank_step_time_s"][2] *= 2.5
    alerts = only(scan(events), "straggler")
    assert [(a.step, a.rank) for a in alerts] == [(302, 2)]  # straggler_steps=3: steps 300, 301, 302
    assert "rank 2 is a straggler" in alerts[0].message and "threshold 1.5×" in alerts[0].message
    assert alerts[0].value > alerts[0].threshold > alerts[0].baseline


def test_straggler_uses_time_outside_communication_when_per_rank_comm_is_known():
    """Synchronous DP: the fast ranks wait inside the all-reduce, so every rank's step time is the same."""
    events = clean_run(world=2)
    for e in events[1:]:
        e["rank_step_time_s"] = [0.1, 0.1]
        e["rank_comm_s"] = [0.05, 0.05] if not 100 <= e["step"] < 110 else [0.08, 0.01]
    alerts = only(scan(events), "straggler")
    assert [(a.step, a.rank) for a in alerts] == [(102, 1)]
    assert "outside communication" in alerts[0].message


def test_ranks_dict_form_is_read_too():
    events = clean_run()
    for e in events[1:]:
        e["ranks"] = {"step_time_s": e.pop("rank_step_time_s")}
    for s in range(300, 305):
        steps_of(events)[s]["ranks"]["step_time_s"][3] *= 3
    assert [(a.step, a.rank) for a in only(scan(events), "straggler")] == [(302, 3)]


def test_loss_spike_fires_at_the_step():
    events = clean_run()
    steps_of(events)[250]["loss"] *= 2
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("loss_spike", 250)]
    assert "MADs" in alerts[0].message


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_nonfinite_loss_fires_immediately_even_in_warmup(bad):
    events = clean_run(steps=50)
    steps_of(events)[2]["loss"] = bad
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("loss_nonfinite", 2)]


def test_nonfinite_loss_streak_is_one_incident():
    events = clean_run(steps=100)
    for s in range(40, 100):
        steps_of(events)[s]["loss"] = None
    assert [(a.kind, a.step) for a in scan(events)] == [("loss_nonfinite", 40)]


def test_comm_frac_jump():
    events = clean_run()
    for s in range(320, 400):
        steps_of(events)[s]["comm_frac"] = 0.5
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("comm_frac_jump", 321)]  # median of 3: two high steps
    assert "50%" in alerts[0].message and "20%" in alerts[0].message


def with_exposed(events, share=0.05):
    for i, e in enumerate(e for e in events if e.get("type") == "step"):
        e["comm_exposed_frac"] = share * (1 + 0.05 * ((i * 7919) % 11 - 5) / 5)  # ±5%, deterministic
    return events


def test_communication_in_flight_growing_behind_backward_is_not_an_alert():
    events = with_exposed(clean_run())
    for s in range(320, 400):
        steps_of(events)[s]["comm_frac"] = 0.5  # in flight 50%, but the step still waits only ~5% for it
    assert only(scan(events), "comm_frac_jump") == []


def test_a_jump_in_exposed_communication_is_the_alert_with_in_flight_as_context():
    events = with_exposed(clean_run())
    for s in range(320, 400):
        steps_of(events)[s].update(comm_frac=0.5, comm_exposed_frac=0.3)
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("comm_frac_jump", 321)]
    message = alerts[0].message
    assert "exposed communication" in message and "30%" in message and "5%" in message
    assert "in flight 50%" in message
    assert alerts[0].value == pytest.approx(0.3) and alerts[0].baseline == pytest.approx(0.05, rel=0.1)


def test_without_exposed_time_the_jump_is_judged_in_flight_and_says_so():
    events = clean_run()  # no comm_exposed_frac: a strategy whose exposed time the host cannot see
    for s in range(320, 400):
        steps_of(events)[s]["comm_frac"] = 0.5
    [alert] = scan(events)
    assert "communication in flight" in alert.message and "not measured" in alert.message


def test_memory_growth_detects_a_steady_leak_but_not_one_jump():
    t = AnomalyThresholds()
    events = clean_run()
    mem = [e["max_mem_bytes"] for e in events[1:]]
    for s in range(100, 500):
        mem[s] = mem[s - 1] * 1.005  # a leak: the peak creeps up every step
    for e, m in zip(events[1:], mem):
        e["max_mem_bytes"] = m
    expected = next(s for s in range(t.warmup_steps + t.memory_window, 500)
                    if mem[s] / mem[s - t.memory_window + 1] - 1 > t.memory_growth)
    alerts = scan(events)
    assert [(a.kind, a.step) for a in alerts] == [("memory_growth", expected)]
    assert "leak" in alerts[0].message

    jump = clean_run()
    for e in jump[1:]:
        e["max_mem_bytes"] = MEM * (1.5 if e["step"] >= 200 else 1.0)  # e.g. one bigger batch: a single rise
    assert only(scan(jump), "memory_growth") == []


def test_warmup_hides_the_first_steps_and_a_restart_warms_up_again():
    events = clean_run(steps=100)
    steps_of(events)[5]["step_time_s"] *= 10  # compilation
    assert scan(events) == []
    steps_of(events)[60]["step_time_s"] *= 10
    assert [(a.kind, a.step) for a in scan(events)] == [("step_time_spike", 60)]

    restarted = clean_run(steps=100) + clean_run(steps=20, seed=1)  # the second "start": a new worker
    restarted[-15]["step_time_s"] *= 10  # step 5 of the restarted worker
    assert scan(restarted) == []


def test_cooldown_one_alert_per_incident_and_rearms_after_quiet_steps():
    t = AnomalyThresholds()
    events = clean_run()
    for s in (100, 110, 200):
        steps_of(events)[s]["loss"] *= 3
    assert [a.step for a in only(scan(events), "loss_spike")] == [100, 200]  # 110 is within the cooldown
    zero = AnomalyThresholds(cooldown_steps=0)
    assert [a.step for a in only(scan(events, zero), "loss_spike")] == [100, 110, 200]
    assert t.cooldown_steps == 20


def test_monitor_observes_one_event_at_a_time_like_scan():
    events = clean_run()
    steps_of(events)[250]["loss"] *= 2
    monitor = AnomalyMonitor()
    live = [alert for event in events for alert in monitor.observe(event)]
    assert live == scan(events) and len(live) == 1
    assert monitor.observe({"type": "eval", "step": 250, "val_loss": 9.0}) == []


def test_scan_run_reads_events_jsonl(tmp_path):
    events = clean_run(steps=120)
    steps_of(events)[100]["loss"] *= 2
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert [(a.kind, a.step) for a in scan_run(tmp_path)] == [("loss_spike", 100)]


@pytest.mark.parametrize("field, value, words", [
    ("throughput_drop", 0.0, "(0, 1)"), ("throughput_drop", 1.5, "30% slower"), ("comm_frac_jump", 1.2, "(0, 1]"),
    ("window", 1, ">= 2"), ("memory_window", 1, ">= 2"), ("min_baseline", 51, "between 2 and window"),
    ("step_time_factor", 0.9, "> 1"), ("straggler_steps", 0, ">= 1"), ("warmup_steps", -1, ">= 0"),
    ("memory_growth", 0, "> 0"), ("loss_mads", float("nan"), "finite number"), ("window", True, "finite number"),
])
def test_threshold_validation(field, value, words):
    with pytest.raises(ValueError, match="invalid anomaly thresholds") as info:
        AnomalyMonitor(AnomalyThresholds(**{field: value}))
    assert field in str(info.value) and words in str(info.value)


def test_diagnosis_requests():
    events = clean_run()
    for s in range(300, 310):
        steps_of(events)[s]["rank_step_time_s"][0] *= 3
    straggler = only(scan(events), "straggler")[0]
    request = diagnosis_request(straggler)
    assert request["profile"] and request["ranks"] == [0, 1] and request["start_step"] == 303
    assert request["steps"] >= 1 and "healthy" in request["why"]
    loss = scan([*clean_run(steps=30)[:-1], {"type": "step", "step": 29, "loss": None}])[0]
    assert diagnosis_request(loss)["profile"] is False and "numerical" in diagnosis_request(loss)["why"]
    assert diagnosis_request(straggler, world_size=1)["ranks"] == [0]
    for kind in KINDS:
        request = diagnosis_request(Alert(kind, 5, None, 1.0, 1.0, 1.0, "m"))
        assert set(request) >= {"profile", "ranks", "steps", "start_step", "why"}
        assert request["profile"] == (kind not in ("loss_spike", "loss_nonfinite"))
    assert diagnosis_request(Alert("memory_growth", 5, None, 1.0, 1.0, 1.0, "m"))["profile_memory"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_profile_summary_with_a_real_profiler(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from labkit.metrics.profile import is_communication, summarize_profile

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        a = torch.randn(128, 128)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                a = torch.tanh(a @ a)
            grads = torch.ones(4096)
            dist.all_reduce(grads)
        summary = summarize_profile(prof, tmp_path / "traces" / "step.json", row_limit=5)
    finally:
        dist.destroy_process_group()
    trace = json.loads(summary.trace_path.read_text())
    assert any("aten::mm" in e.get("name", "") for e in trace["traceEvents"])
    assert "aten::mm" in summary.table and "Self CPU" in summary.table
    assert summary.time_kind == "cpu" and summary.compute_us > 0 and summary.comm_us > 0
    assert 0 < summary.comm_frac < 1 and "communication" in summary.describe()
    assert is_communication("c10d::allreduce_") and is_communication("ncclDevKernel_AllGather_RING_LL")
    assert not is_communication("aten::mm")
