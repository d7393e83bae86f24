import json
import os

import pytest

from labkit.hardware import (MATMUL_REPEATS, QUICK_REPEATS, cpu_fingerprint, cpu_peak_tflops, device_peak,
                             gpu_peak_tflops, match_gpu)
from labkit.metrics import CommTimer, EventWriter, achieved_tflops, mfu, read_events
from labkit.metrics.timers import union_length


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H200", "NVIDIA H200"), ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"), ("NVIDIA L4", "NVIDIA L4"),
    ("NVIDIA L40S", "NVIDIA L40S"), ("NVIDIA B200", "NVIDIA B200"), ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-16GB"),
    # forgiven: case, spacing, a leading "NVIDIA "
    ("nvidia  h100 80gb hbm3 ", "NVIDIA H100 80GB HBM3"), ("H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA GeForce GTX 1080", None), ("NVIDIA H100", None), ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
])
def test_gpu_names_match_exactly(name, row):
    assert match_gpu(name) == row


@pytest.mark.parametrize("name,neighbour", [
    ("NVIDIA L40", "NVIDIA L4"), ("NVIDIA A10G", "NVIDIA A10"), ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090"),
])
def test_a_sku_never_gets_its_neighbours_peak(name, neighbour):
    """Each name contains its neighbour's: substring matching gave an L40 the L4's peak, and so on."""
    assert match_gpu(name) in (name, None) and match_gpu(name) != neighbour
    for dtype in ("bf16", "fp32"):
        assert gpu_peak_tflops(name, dtype) != gpu_peak_tflops(neighbour, dtype)
    assert gpu_peak_tflops("NVIDIA L40", "bf16") == pytest.approx(181.05)  # the L40 datasheet, dense
    assert gpu_peak_tflops("NVIDIA A10G", "bf16") is None  # no published figures: n/a, not the A10's
    assert gpu_peak_tflops("NVIDIA GeForce RTX 4090 D", "bf16") is None


def test_unknown_peaks_are_none_not_guesses():
    assert gpu_peak_tflops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert gpu_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16 tensor cores
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert mfu(1.0, None) is None and mfu(1.0, 4.0) == 0.25


def test_a_gpu_peak_says_which_device_and_an_unknown_one_is_na(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40")
    peak = device_peak("cuda", "bf16")
    assert peak["tflops"] == pytest.approx(181.05)
    assert "NVIDIA L40 " in peak["source"] and "dense bf16" in peak["source"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A10G")
    peak = device_peak("cuda", "bf16")
    assert peak["tflops"] is None and peak["source"].startswith("n/a") and mfu(10.0, peak["tflops"]) is None


# ---------------------------------------------------------------- the CPU peak, with an injected "measurement"
# No test here times this CPU: each passes a fake measuring function with made-up samples, so the
# behaviour checked (best-of, what the cache records, when it re-measures) is the same on every machine.

class FakeMatmuls:
    """Stands in for ``matmul_samples``: returns the samples it is given and records every call."""

    def __init__(self, full, quick=None):
        self.full, self.quick, self.calls = list(full), list(quick or [min(full)]), []

    def __call__(self, dtype, threads, repeats=MATMUL_REPEATS, size=None):
        self.calls.append({"dtype": dtype, "threads": threads, "repeats": repeats, "size": size})
        return {"size": size or 1024, "samples": list(self.full if repeats == MATMUL_REPEATS else self.quick)}

    @property
    def full_measurements(self) -> int:
        return sum(c["repeats"] == MATMUL_REPEATS for c in self.calls)


@pytest.fixture
def cpu_cache(tmp_path, monkeypatch):
    """An empty cache of the test's own, and a quiet machine (load 0.3) unless the test says otherwise."""
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    return tmp_path / "cpu_peak.json"


def test_cpu_peak_is_the_best_of_repeats_and_is_cached(cpu_cache):
    fake = FakeMatmuls([0.05, 0.09, 0.07, 0.08, 0.06])
    first = cpu_peak_tflops("fp32", 3, measure=fake)
    assert first["tflops"] == 0.09 and fake.calls == [{"dtype": "fp32", "threads": 3, "repeats": MATMUL_REPEATS,
                                                       "size": None}]
    second = cpu_peak_tflops("fp32", 3, measure=fake)  # a quick check at the cached size; slower: cache stands
    assert second["tflops"] == 0.09 and fake.full_measurements == 1
    assert fake.calls[1] == {"dtype": "fp32", "threads": 3, "repeats": QUICK_REPEATS, "size": 1024}
    cpu_peak_tflops("bf16", 3, measure=fake)
    assert fake.full_measurements == 2 and len(json.loads(cpu_cache.read_text())) == 2


def test_measure_matmul_tflops_is_the_fastest_sample(monkeypatch):
    import labkit.hardware as hw

    monkeypatch.setattr(hw, "matmul_samples", lambda *a, **k: {"size": 512, "samples": [0.2, 0.7, 0.4]})
    assert hw.measure_matmul_tflops("fp32", threads=2) == 0.7


def test_the_cache_records_load_machine_and_time(cpu_cache):
    import time

    cpu_peak_tflops("fp32", 2, measure=FakeMatmuls([0.08] * 5))
    record = json.loads(cpu_cache.read_text())["fp32|threads=2"]
    assert record["load_1min"] == 0.3 and record["cpus"] == os.cpu_count()
    assert record["machine"] == cpu_fingerprint() and {"cpu", "cores", "isa", "torch"} <= set(record["machine"])
    assert record["samples"] == [0.08] * 5 and record["size"] == 1024 and record["threads"] == 2
    assert abs(record["measured_at"] - time.time()) < 60


def test_a_different_machine_is_measured_again(cpu_cache, monkeypatch):
    import labkit.hardware as hw

    fake = FakeMatmuls([0.08] * 5)
    cpu_peak_tflops("fp32", 1, measure=fake)
    here = cpu_fingerprint()
    for changed in ({"isa": ["avx2", "fma"] if "avx512f" in here["isa"] else ["avx2", "fma", "avx512f"]},
                    {"cores": here["cores"] + 8}, {"torch": "0.0.1"}):
        monkeypatch.setattr(hw, "cpu_fingerprint", lambda changed=changed: {**here, **changed})
        before = fake.full_measurements
        peak = cpu_peak_tflops("fp32", 1, measure=fake)
        assert fake.full_measurements == before + 1, changed
        assert "different machine" in peak["measurement"]["reason"]


def test_an_implausibly_low_cached_peak_is_measured_again(cpu_cache):
    busy_day = FakeMatmuls([0.0564] * 5)  # measured while something else ran
    cpu_peak_tflops("fp32", 1, measure=busy_day)
    close = FakeMatmuls([0.0895] * 5, quick=[0.06])  # within PLAUSIBLE_MARGIN: noise, the cache stands
    assert cpu_peak_tflops("fp32", 1, measure=close)["tflops"] == 0.0564 and close.full_measurements == 0
    idle = FakeMatmuls([0.0895] * 5, quick=[0.085])  # a quick check 1.5x faster: the cache was low
    peak = cpu_peak_tflops("fp32", 1, measure=idle)
    assert peak["tflops"] == 0.0895 and idle.full_measurements == 1 and "quick check" in peak["measurement"]["reason"]


def test_a_peak_measured_under_load_is_measured_again_once_the_machine_is_quiet(cpu_cache, monkeypatch):
    overloaded = os.cpu_count() + 2.0
    monkeypatch.setattr(os, "getloadavg", lambda: (overloaded, overloaded, overloaded))
    first = FakeMatmuls([0.05] * 5)
    cpu_peak_tflops("fp32", 1, measure=first)
    still_busy = FakeMatmuls([0.09] * 5, quick=[0.05])
    assert cpu_peak_tflops("fp32", 1, measure=still_busy)["tflops"] == 0.05 and still_busy.full_measurements == 0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    quiet = FakeMatmuls([0.09] * 5, quick=[0.05])
    peak = cpu_peak_tflops("fp32", 1, measure=quiet)
    assert peak["tflops"] == 0.09 and quiet.full_measurements == 1 and peak["measurement"]["load_1min"] == 0.2


def test_a_cache_from_before_the_load_was_recorded_is_measured_again(cpu_cache):
    cpu_cache.write_text(json.dumps({"fp32|threads=1": {"tflops": 0.0564, "measured_at": 0}}))
    fake = FakeMatmuls([0.0895] * 5)
    assert cpu_peak_tflops("fp32", 1, measure=fake)["tflops"] == 0.0895 and fake.full_measurements == 1


def test_a_peak_measured_by_the_old_procedure_is_measured_again(cpu_cache):
    old = FakeMatmuls([0.0501] * 5)
    cpu_peak_tflops("fp32", 1, measure=old)
    cache = json.loads(cpu_cache.read_text())
    del cache["fp32|threads=1"]["method"]  # as the old procedure wrote it: 1024² matmuls, best of 5
    cpu_cache.write_text(json.dumps(cache))
    new = FakeMatmuls([0.0952] * 20, quick=[0.05])  # a quick check no faster: only the method says it is stale
    peak = cpu_peak_tflops("fp32", 1, measure=new)
    assert (peak["tflops"] == 0.0952 and new.full_measurements == 1
            and "older procedure" in peak["measurement"]["reason"])


def test_the_cpu_peak_says_what_it_is(cpu_cache):
    source = cpu_peak_tflops("fp32", 1, measure=FakeMatmuls([0.0801, 0.0895, 0.0850, 0.0812, 0.0870]))["source"]
    assert source.startswith("this process's 1-thread fp32 matmul peak (89.5 GFLOP/s")
    assert "best of 5 1024×1024 matmuls" in source and f"load 0.3 on {os.cpu_count()} CPUs" in source
    assert "4-thread bf16" in cpu_peak_tflops("bf16", 4, measure=FakeMatmuls([1.5] * 5))["source"]


def test_the_dashboard_states_what_mfu_is_a_percentage_of():
    from labkit.widgets import dashboard_figure

    source = "this process's 1-thread fp32 matmul peak (89.5 GFLOP/s: best of 5 1024×1024 matmuls)"
    steps = [{"type": "step", "step": i, "loss": 2.0, "tokens_per_s": 1.0, "mfu": 0.2, "comm_frac": 0.1}
             for i in range(3)]
    mfu_ax = dashboard_figure([{"type": "start", "peak_source": source}, *steps]).axes[2]
    assert any("1-thread fp32 matmul peak" in " ".join(t.get_text().split()) for t in mfu_ax.texts)
    na = "n/a: no bf16 peak known for 'NVIDIA A10G'"
    mfu_ax = dashboard_figure([{"type": "start", "peak_source": na}, *(dict(e, mfu=None) for e in steps)]).axes[2]
    assert "NVIDIA A10G" in " ".join(mfu_ax.texts[0].get_text().split()) and not mfu_ax.lines


def test_the_timed_matmuls_come_after_a_warm_up():
    """An idle core's clock takes time to rise: the first calls are slow. Only warm calls may be timed."""
    from labkit.cpu import WARMUP_S, timed_calls

    now, calls = [0.0], []

    def ramping_matmul():  # 40 ms each until the clock has risen (0.15 s of work), 20 ms after
        calls.append(now[0])
        now[0] += 0.040 if now[0] < 0.15 else 0.020

    seconds = timed_calls(ramping_matmul, 5, clock=lambda: now[0])
    assert seconds == pytest.approx([0.020] * 5) and WARMUP_S >= 0.15
    assert len(calls) - 5 >= 2 and calls[-5] >= WARMUP_S  # untimed calls filled the warm-up first
    assert timed_calls(ramping_matmul, 1, warmup_s=0, clock=lambda: now[0]) == pytest.approx([0.020])


def test_the_timed_matmul_is_large_but_short_enough_to_run_between_preemptions():
    """A worker's core: 1 thread, about 90 GFLOP/s. The old rule (grow until a matmul takes 20 ms) timed 1024² matmuls,
    which a shared machine nearly always interrupts; 512² matmuls (3 ms) are already at the peak and fit between."""
    from labkit.cpu import MATMUL_REPEATS, MAX_MATMUL_SIZE, pick_size

    def at_90_gflops(n):
        return 2 * n**3 / 90e9

    n = pick_size(at_90_gflops)
    assert n == 512 and 0.001 < at_90_gflops(n) < 0.01 and MATMUL_REPEATS >= 20
    assert pick_size(lambda n: 2 * n**3 / 4e12) == 2048  # 16 fast threads: a larger matrix for the same time
    assert pick_size(lambda n: 0.0) == MAX_MATMUL_SIZE and pick_size(lambda n: 1.0) == 256  # emulated bf16: 256


def test_the_peak_is_measured_at_the_workers_thread_count_into_one_output():
    import torch

    import labkit.hardware as hw

    seen, real_matmul = [], torch.matmul

    def watched(a, b, out=None):
        seen.append((torch.get_num_threads(), out is not None))
        return real_matmul(a, b, out=out)

    before = torch.get_num_threads()
    try:
        torch.matmul = watched
        got = hw.matmul_samples("fp32", threads=1, repeats=3, size=128, warmup_s=0.01)
    finally:
        torch.matmul = real_matmul
    assert len(got["samples"]) == 3 and set(seen) == {(1, True)}  # 1 thread, like a worker; no allocation timed
    assert torch.get_num_threads() == before


def test_real_cpu_measurement_is_plausible():
    """The one test that times this CPU: only that the numbers are in a sane range, never how fast it is."""
    from labkit.hardware import matmul_samples, measure_matmul_tflops

    assert 1e-4 < measure_matmul_tflops("fp32", threads=1, repeats=2, size=256) < 50
    got = matmul_samples("fp32", threads=1, repeats=2)
    assert got["size"] >= 512 and len(got["samples"]) == 2 and all(s > 0 for s in got["samples"])


@pytest.mark.multiproc
def test_cpu_fingerprint_names_the_kernel_level_that_was_forced():
    """ATEN_CPU_CAPABILITY lowers torch's kernels (how an AVX-512 machine runs an AVX2 machine's paths):
    the fingerprint reports the level in force, read from torch in a fresh process."""
    import subprocess
    import sys

    code = "from labkit.hardware import cpu_fingerprint; print(cpu_fingerprint()['torch_cpu_capability'])"
    forced = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert forced == "DEFAULT"
    here = cpu_fingerprint()
    assert here["cpu"] and here["cores"] >= 1 and set(here["isa"]) <= {"avx2", "fma", "avx512f", "avx512_bf16",
                                                                        "avx512_fp16", "amx_bf16"}


def test_user_override_wins():
    assert device_peak("cpu", "fp32", 1, override=2.5) == {"tflops": 2.5,
                                                           "source": "metrics.peak_tflops (set by the user)"}


def test_achieved_tflops():
    assert achieved_tflops(6e6, 1000, 2.0, 2) == pytest.approx(6e6 * 1000 / 2 / 2 / 1e12)


def test_union_length_does_not_double_count_overlaps():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(3, 4), (0, 10)]) == pytest.approx(10.0)


def test_comm_timer_collects_and_resets():
    timer = CommTimer()
    a = timer.launched(100)
    b = timer.launched(50)
    timer.completed(a)
    timer.completed(b)
    got = timer.collect()
    assert got["comm_bytes"] == 150 and got["comm_calls"] == 2 and got["comm_s"] >= 0
    assert got["comm_exposed_s"] <= got["comm_s"] + 1e-9
    assert timer.collect() == {"comm_s": 0.0, "comm_exposed_s": 0.0, "comm_bytes": 0, "comm_calls": 0,
                               "comm_intervals": []}


def test_exposed_communication_is_what_runs_after_compute_is_done():
    now = [0.0]
    timer = CommTimer(clock=lambda: now[0])

    def at(t, action, *args):
        now[0] = t
        return action(*args)

    a = at(2.0, timer.launched, 10)  # bucket 1 launched mid-backward...
    at(4.0, timer.completed, a)  # ...and done while backward still computes: hidden
    at(4.5, timer.grad_ready)  # last gradient ready: compute is over
    b = at(4.5, timer.launched, 10)
    at(7.0, timer.completed, b)  # the step waits 2.5 s on this one
    got = timer.collect()
    assert got["comm_s"] == pytest.approx(4.5) and got["comm_exposed_s"] == pytest.approx(2.5)
    c = at(10.0, timer.launched, 10)  # no hooks (naive DDP): compute ends when backward returns
    at(9.0, timer.backward_done)
    at(11.0, timer.completed, c)
    assert timer.collect()["comm_exposed_s"] == pytest.approx(1.0)


def test_events_round_trip_and_tail_incrementally(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path)
    writer.write("step", step=0, loss=float("nan"), mfu=None)
    events, offset = read_events(path)
    assert events[0]["loss"] is None and events[0]["type"] == "step"  # NaN is not JSON: written as null
    with open(path, "a") as f:
        f.write('{"type": "step", "st')  # a line still being written is not read
    more, offset2 = read_events(path, offset)
    assert more == [] and offset2 == offset
    with open(path, "a") as f:
        f.write('ep": 1}\n')
    more, _ = read_events(path, offset)
    assert more == [{"type": "step", "step": 1}]
    writer.close()


def test_recommend_explains_each_choice():
    from labkit.hardware import detect, recommend

    h100 = {"device": "cuda", "count": 8, "name": "NVIDIA H100", "bf16": True, "fp16": True, "fp8": True,
            "flash_attn": True, "triton": True}
    advice = recommend(h100)
    assert advice["backend"][0] == "nccl" and advice["precision"][0] == "bf16"
    assert advice["attention"][0] == "flash_attn" and advice["compile"][0] == "verify"
    v100 = dict(h100, name="Tesla V100", bf16=False, fp8=False, flash_attn=False)
    assert recommend(v100)["precision"][0] == "fp16" and recommend(v100)["attention"][0] == "sdpa"
    here = detect()
    assert here["device"] == "cpu" and recommend(here, FAST_BF16)["backend"][0] == "gloo"
    assert all(len(reason) > 20 for _, reason in recommend(here, FAST_BF16).values())


FAST_BF16 = {"fp32": 0.090, "bf16": 0.190, "speedup": 0.190 / 0.090, "size": 256, "threads": 1}
SLOW_BF16 = {"fp32": 0.080, "bf16": 0.001, "speedup": 0.001 / 0.080, "size": 256, "threads": 1}


def test_recommend_decides_bf16_on_a_cpu_by_measurement_and_explains_it_with_the_flags(monkeypatch):
    """The issue's EPYC: no native bf16, bf16 24x slower. Flags alone are not enough: a CPU can list avx512_bf16
    while its kernels are limited (ONEDNN_MAX_CPU_ISA=AVX2) and bf16 runs at a hundredth of fp32's speed."""
    from labkit.hardware import recommend

    epyc = {"device": "cpu", "name": "AMD EPYC", "bf16": False, "bf16_flags": [], "flash_attn": False}
    choice, why = recommend(epyc, SLOW_BF16)["precision"]
    assert choice == "fp32" and "×0.013" in why and "no native bf16" in why and "fp32 is faster" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    listed = dict(epyc, bf16=True, bf16_flags=["avx512_bf16"])
    choice, why = recommend(listed, SLOW_BF16)["precision"]
    assert choice == "fp32" and "lists avx512_bf16, but" in why and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    choice, why = recommend(listed, FAST_BF16)["precision"]
    assert choice == "bf16" and "×2.1" in why and "avx512_bf16" in why
    even = dict(FAST_BF16, bf16=0.095, speedup=0.095 / 0.090)  # within BF16_WORTH_IT: not worth the casts
    assert recommend(listed, even)["precision"] == ("fp32", recommend(listed, even)["precision"][1])
    assert "fp32 is as fast" in recommend(listed, even)["precision"][1]


class FakeProbe:
    """Stands in for ``bf16_samples``: a slow measurement that returns a different speed each time it runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, threads):
        import time

        self.calls += 1
        time.sleep(0.2)
        return {"fp32": 0.09, "bf16": 0.09 * (1 + self.calls), "size": 256, "threads": threads}


def test_the_bf16_probe_is_cached_per_machine_and_the_ranks_of_a_run_read_one_measurement(cpu_cache, monkeypatch):
    import threading

    import labkit.hardware as hw

    probe, got = FakeProbe(), []
    ranks = [threading.Thread(target=lambda: got.append(hw.bf16_speed(1, measure=probe))) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert probe.calls == 1 and got[0] == got[1] and got[0]["speedup"] == pytest.approx(2.0)
    assert hw.bf16_speed(1, measure=probe)["speedup"] == pytest.approx(2.0) and probe.calls == 1  # cached
    here = hw.cpu_fingerprint()
    monkeypatch.setattr(hw, "cpu_fingerprint", lambda: {**here, "onednn_limit": {"ONEDNN_MAX_CPU_ISA": "AVX2"}})
    assert hw.bf16_speed(1, measure=probe)["speedup"] == pytest.approx(3.0) and probe.calls == 2  # kernels changed


def test_the_bf16_probe_measures_fp32_and_bf16_in_turns():
    from labkit.hardware import bf16_samples

    order = []

    def measure(dtype, threads, repeats, size):
        order.append(dtype)
        return {"size": size, "samples": [0.1 if dtype == "fp32" else 0.2]}

    got = bf16_samples(1, rounds=3, measure=measure)
    assert order == ["fp32", "bf16", "bf16", "fp32", "fp32", "bf16"] and (got["fp32"], got["bf16"]) == (0.1, 0.2)


def test_a_kernel_limit_is_part_of_the_machine(monkeypatch):
    from labkit.hardware import cpu_fingerprint

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = cpu_fingerprint()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_fingerprint() == {**plain, "onednn_limit": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


def test_auto_settings_are_resolved_with_a_reason(tmp_path):
    import json

    from helpers import tiny_config
    from labkit.distributed import threads_per_proc
    from labkit.hardware import bf16_choice, bf16_speed, detect
    from labkit.train import train

    cfg = tiny_config(**{"run.steps": 2, "precision.mode": "auto", "attention.backend": "auto"})
    summary = train(cfg, tmp_path)
    start = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
    measured = bf16_speed(threads_per_proc(cfg, 1))  # what the run measured at its thread count, from the cache
    expected = bf16_choice(measured, detect()["bf16_flags"])[0]
    assert summary["auto"]["precision.mode"].startswith(f"auto → {expected}: ")
    assert summary["auto"]["attention.backend"].startswith("auto → sdpa: ") and start["auto"] == summary["auto"]
    assert start["attention_kernel"].startswith("sdpa → ")


def test_a_failure_during_a_requested_stop_is_reported_as_the_stop(tmp_path):
    from labkit.metrics.events import as_requested_stop, request_stop

    seen = {"status": "failed", "error": "DistBackendError: peer closed"}
    assert as_requested_stop(dict(seen), tmp_path)["status"] == "failed"  # no request: a real failure
    request_stop(tmp_path)
    summary = as_requested_stop(dict(seen), tmp_path)
    assert summary["status"] == "stopped" and "peer closed" in summary["error"]
    assert as_requested_stop({"status": "finished"}, tmp_path)["status"] == "finished"
