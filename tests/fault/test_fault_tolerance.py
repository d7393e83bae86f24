"""Fault tolerance: checkpoints that are whole or ignored, and the proof that nothing is lost.

The proof matrix launches real 2-process runs through the elastic agent, injects each fault kind
and checks the recovered run's final model against an uninterrupted one, bit for bit.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.config import ConfigError
from labkit.validation import validate
from labkit.fault import Checkpointer, list_checkpoints, newest_valid, verify
from labkit.fault.checkpoint import PARTIAL, flip_byte, prune
from labkit.fault.recovery import expected_overhead, young_daly_interval
from labkit.launcher import _alive, free_port
from helpers import tiny_config

STEPS, EVERY, FAULT_STEP = 24, 5, 12
FAULTED = {"run.steps": STEPS, "fault.checkpoint_every": EVERY, "fault.max_restarts": 1, "fault.keep_last": 3,
           "comm.timeout_s": 6.0, "fault.inject_rank": 1, "fault.inject_step": FAULT_STEP}


# ---------------------------------------------------------------- checkpoints in one process

@pytest.fixture
def group():
    """A real gloo group of one process (DCP's collectives run, trivially)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "loader": {"epoch": seed, "step_in_epoch": 3}, "step": seed}


def _save(directory, steps, keep=10, async_save=False):
    ckpt = Checkpointer(directory, keep=keep, async_save=async_save, log=lambda line: None)
    for step in steps:
        ckpt.save(step, _state(step))
    ckpt.close()
    return ckpt


def test_save_then_restore_round_trip_with_manifest(group, tmp_path):
    _save(tmp_path, [4])
    (path,) = list_checkpoints(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert path.name == "step_00000004" and manifest["step"] == 4 and ".metadata" in manifest["files"]
    assert manifest["total_bytes"] == sum(f.stat().st_size for f in path.iterdir() if f.name != "manifest.json")
    assert verify(path) is None
    empty = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}, "loader": {"epoch": 0, "step_in_epoch": 0},
             "step": 0}
    restored_path, state = Checkpointer(tmp_path).restore(lambda: empty)
    assert restored_path == path
    want = _state(4)
    assert torch.equal(state["model"]["w"], want["model"]["w"]) and torch.equal(state["model"]["b"], want["model"]["b"])
    assert state["loader"] == want["loader"] and state["step"] == 4


def test_async_save_is_sealed_and_equal(group, tmp_path):
    _save(tmp_path / "sync", [2])
    ckpt = _save(tmp_path / "async", [2], async_save=True)
    assert ckpt.pending is None and verify(tmp_path / "async" / "step_00000002") is None
    for name in ("__0_0.distcp",):
        assert (tmp_path / "sync" / "step_00000002" / name).read_bytes() == \
               (tmp_path / "async" / "step_00000002" / name).read_bytes()


def test_manifest_detects_truncation_and_bit_flips(group, tmp_path):
    _save(tmp_path, [1, 2, 3])
    newest, middle, oldest = list_checkpoints(tmp_path)
    flip_byte(newest)
    assert "SHA-256" in verify(newest)
    data = middle / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    assert "truncated" in verify(middle)
    lines = []
    assert newest_valid(tmp_path, log=lines.append) == oldest
    assert len(lines) == 2 and "step_00000003" in lines[0] and "corrupted" in lines[0]


def test_missing_manifest_and_partial_saves_are_never_used(group, tmp_path):
    _save(tmp_path, [1, 2])
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    assert "never finished" in verify(tmp_path / "step_00000002")
    (tmp_path / f"step_00000009{PARTIAL}").mkdir()
    assert newest_valid(tmp_path, log=lambda line: None).name == "step_00000001"
    Checkpointer(tmp_path)  # a new run clears interrupted saves
    assert not (tmp_path / f"step_00000009{PARTIAL}").exists()


def test_keep_last_k(group, tmp_path):
    _save(tmp_path, range(6), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000004"]
    assert [p.name for p in prune(tmp_path, 1)] == ["step_00000004"]


def test_young_daly_interval_minimises_expected_overhead():
    best = young_daly_interval(checkpoint_s=2.0, mtbf_s=3600.0)
    assert best == pytest.approx((2 * 2.0 * 3600.0) ** 0.5)
    around = [expected_overhead(best * f, 2.0, 3600.0)["total"] for f in (0.5, 0.9, 1.0, 1.1, 2.0)]
    assert min(around) == around[2]
    with pytest.raises(ValueError, match="MTBF"):
        young_daly_interval(1.0, 0.0)


@pytest.mark.parametrize("overrides, nproc, message", [
    ({"fault.max_restarts": -1}, 2, "fault.max_restarts: must be >= 0"),
    ({"fault.inject": "crash", "fault.inject_rank": 2}, 2, "fault.inject_rank=2 does not exist: ranks are 0..1"),
    ({"fault.inject": "corrupt_checkpoint"}, 2, "needs checkpoints"),
    ({"fault.inject": "corrupt_checkpoint", "fault.checkpoint_every": 5, "fault.inject_step": 8}, 2,
     r"inject_step=8 finds 1 checkpoint\(s\) saved \(every 5 steps\).*inject at step >= 9"),
    ({"fault.inject": "corrupt_checkpoint", "fault.checkpoint_every": 5, "fault.inject_step": 9,
      "fault.keep_last": 1}, 2, "keep fault.keep_last >= 2"),
    ({"fault.keep_last": 0}, 1, "fault.keep_last"),
    ({"fault.checkpoint_dir": "/proc/labkit-checkpoints"}, 1, "cannot write in /proc/labkit-checkpoints"),
    ({"fault.checkpoint_dir": "/etc/hostname/checkpoints"}, 1, "cannot write in .*Not a directory"),
])
def test_bad_fault_config_is_refused_before_workers_start(overrides, nproc, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**overrides), nproc=nproc)


def test_launch_refuses_bad_fault_config_without_starting_workers(tmp_path):
    with pytest.raises(ConfigError, match="inject_rank"):
        labkit.launch(tiny_config(**{"fault.inject": "hang", "fault.inject_rank": 5}), nproc=2, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "pids").exists()


# ---------------------------------------------------------------- every strategy resumes exactly

STRATEGIES = {
    "torch_ddp": {}, "ddp_naive": {"parallel.dp.strategy": "ddp_naive"},
    "ddp_bucketed": {"parallel.dp.strategy": "ddp_bucketed"}, "zero1": {"parallel.dp.strategy": "zero1"},
    "zero2": {"parallel.dp.strategy": "zero2"}, "zero3": {"parallel.dp.strategy": "zero3"},
    "fsdp2": {"parallel.dp.strategy": "fsdp2"},
    "local_sgd": {"comm.sync": "local_sgd", "comm.sync_every": 3},
    "diloco": {"comm.sync": "diloco", "comm.sync_every": 3},
    "torch_ddp-async": {"fault.async_save": True},
    # a compressor's error memory and warm start are part of the state (rebuilt DDP buckets included)
    "torch_ddp-topk": {"comm.compression": "topk"},
    "torch_ddp-powersgd": {"comm.compression": "powersgd", "comm.powersgd_rank": 2},
    "ddp_bucketed-sign": {"parallel.dp.strategy": "ddp_bucketed", "comm.compression": "sign"},
    "ddp_bucketed-powersgd": {"parallel.dp.strategy": "ddp_bucketed", "comm.compression": "powersgd",
                              "parallel.dp.bucket_mb": 0.02},
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per strategy, in one 2-process group: a full 10-step run saving every 4 steps, then a fresh
    run that resumes from that run's newest checkpoint (step 7) and trains steps 8 and 9."""
    root = tmp_path_factory.mktemp("resume")
    cases = []
    for name, extra in STRATEGIES.items():
        full = {"run.steps": 10, "fault.checkpoint_every": 4, "fault.keep_last": 5, **extra,
                "fault.checkpoint_dir": str(root / f"{name}-full" / "checkpoints"), **_tiny()}
        cases += [{"name": f"{name}-full", "overrides": full}, {"name": f"{name}-resumed", "overrides": full}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(root), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def _tiny() -> dict:
    return {
        "run.seed": 7, "run.eval_every": 0, "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32,
        "model.block_size": 32, "data.batch_size": 8, "data.micro_batch_size": 4, "optim.warmup_steps": 2}


def _events(run_dir, kind):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == kind]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_resumes_bit_for_bit(resumed, name):
    full, again = resumed / f"{name}-full", resumed / f"{name}-resumed"
    (resume,) = _events(again, "resume")
    assert resume["next_step"] == 8 and [e["step"] for e in _events(again, "step")] == [8, 9]
    assert [e["loss"] for e in _events(again, "step")] == [e["loss"] for e in _events(full, "step")][8:]
    want, got = (torch.load(d / "final_model.pt", weights_only=True) for d in (full, again))
    assert all(torch.equal(got[k], want[k]) for k in want), name
    saves = _events(full, "checkpoint")
    assert [s["step"] for s in saves] == [3, 7] and all(s["bytes"] > 0 and s["blocking_s"] >= 0 for s in saves)


# ---------------------------------------------------------------- the proof matrix

def _final(run) -> dict:
    return torch.load(run.run_dir / "final_model.pt", weights_only=True)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def clean_run():
    run = labkit.launch(tiny_config(**FAULTED), nproc=2)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    return run


def _faulted(kind: str, **extra):
    run = labkit.launch(tiny_config(**{**FAULTED, "fault.inject": kind, **extra}), nproc=2)
    return run


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["crash", "hang", "corrupt_checkpoint"])
def test_recovered_run_equals_uninterrupted_run(clean_run, kind):
    run = _faulted(kind)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    assert _bitwise_equal(_final(run), _final(clean_run))
    summary = run.summary
    (fault,) = summary["faults"]
    assert summary["restarts"] == 1 and fault["kind"] == kind and fault["rank"] == 1
    # the recomputed steps are logged twice in events.jsonl, but the curve shows each step once
    assert len(_events(run.run_dir, "step")) > STEPS
    assert run.metrics["step"] == clean_run.metrics["step"] == list(range(STEPS))
    assert run.metrics["loss"] == clean_run.metrics["loss"]
    lost_at_most = 2 * EVERY if kind == "corrupt_checkpoint" else EVERY  # one bad checkpoint: one more interval
    assert 0 <= fault["steps_recomputed"] <= lost_at_most
    assert 0 < fault["recovery_s"] < 120
    print(f"{kind}: recovered in {fault['recovery_s']:.1f} s, {fault['steps_recomputed']} steps recomputed")
    if kind == "corrupt_checkpoint":
        (skipped,) = _events(run.run_dir, "checkpoint_invalid")
        assert "corrupted" in skipped["message"]


@pytest.mark.multiproc
def test_kill_from_outside_recovers_bit_for_bit(clean_run):
    run = _faulted("none")
    deadline = time.time() + 120
    while len(run.metrics["step"]) < FAULT_STEP and time.time() < deadline:
        time.sleep(0.1)
    pid = run.kill_rank(1)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    assert _bitwise_equal(_final(run), _final(clean_run))
    (fault,) = run.summary["faults"]
    assert fault["kind"] == "kill" and fault["steps_recomputed"] <= EVERY and fault["recovery_s"] > 0
    assert pid not in run.worker_pids or not _alive(pid)


@pytest.mark.multiproc
def test_straggler_changes_timing_not_the_model(clean_run):
    run = _faulted("straggler", **{"fault.straggler_ms": 60.0})
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    assert _bitwise_equal(_final(run), _final(clean_run))
    steps = run.metrics
    after = [i for i, s in enumerate(steps["step"]) if s >= FAULT_STEP]
    # in lock-step training both ranks' steps take as long; rank 1 is the busy one, rank 0 waits
    # (medians over the steps after the fault: one step's timing on a shared machine can be anything)
    busier = statistics.median(steps["rank_busy_s"][i][1] - steps["rank_busy_s"][i][0] for i in after)
    waits_more = statistics.median(steps["rank_comm_s"][i][0] - steps["rank_comm_s"][i][1] for i in after)
    assert busier > 0.03 and waits_more > 0
    assert run.summary["restarts"] == 0


@pytest.mark.multiproc
def test_nan_gradients_are_never_applied(clean_run):
    """A NaN on one rank reaches every rank through the all-reduce; the global norm is NaN on all of
    them, so all drop that update — exactly as a run told to skip that step's update."""
    run = _faulted("nan")
    reference = labkit.launch(tiny_config(**{**FAULTED, "fault.skip_steps": [FAULT_STEP]}), nproc=2)
    for r in (run, reference):
        assert r.wait(timeout=300) == "finished", r.log()[-3000:]
    assert _bitwise_equal(_final(run), _final(reference))
    assert not _bitwise_equal(_final(run), _final(clean_run))
    skipped = [s for s, flag in zip(run.metrics["step"], run.metrics["skipped"]) if flag]
    assert skipped == [FAULT_STEP] and all(torch.isfinite(t).all() for t in _final(run).values())


def test_cli_kill_names_the_problem_when_no_worker_is_live(tmp_path, capsys):
    from labkit.cli import main

    assert main(["kill", str(tmp_path), "--rank", "1"]) == 2
    assert "no live worker of rank 1" in capsys.readouterr().err


def test_a_restarted_runs_wall_time_counts_from_its_first_attempt(tmp_path):
    from labkit.metrics.events import EventWriter, first_event_time

    writer = EventWriter(tmp_path / "events.jsonl")
    first = writer.write("start", attempt=0)["time"]
    writer.write("resume", attempt=1)
    writer.close()
    assert first_event_time(tmp_path / "events.jsonl", default=0.0) == first
    assert first_event_time(tmp_path / "missing.jsonl", default=5.0) == 5.0


# ---------------------------------------------------------------- checkpoint_every: auto (Young/Daly)


def test_the_automatic_interval_is_youngs_in_whole_steps_of_the_slowest_ranks_figures():
    from labkit.fault.tolerance import AutoInterval

    auto = AutoInterval(mtbf_s=100.0)
    auto.step_s = [0.4, 0.5, 0.9]  # median 0.5 s
    slowest = lambda t: t * torch.tensor([1.0, 1.0], dtype=torch.float64)  # noqa: E731 - one rank: its own
    chosen = auto.choose(0.5, slowest)  # √(2 × 0.5 s × 100 s) = 10 s = 20 steps of 0.5 s
    assert chosen["interval_s"] == pytest.approx(10.0) and chosen["steps"] == 20 and "√(2·δ·M)" in chosen["why"]
    doubled = auto.choose(0.5, lambda t: t * 2)  # another rank twice as slow: everyone plans with its figures
    assert doubled["save_s"] == 1.0 and doubled["step_s"] == 1.0 and doubled["steps"] == round(200 ** 0.5)


def test_a_run_with_an_automatic_interval_probes_once_then_checkpoints_at_the_interval_it_chose(tmp_path):
    from labkit.fault.tolerance import PROBE_STEPS
    from labkit.train import train

    train(tiny_config(**{"run.steps": 24, "fault.checkpoint_every": "auto", "fault.mtbf_s": 0.05,
                         "fault.keep_last": 30}), tmp_path)
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    (chosen,) = [e for e in events if e["type"] == "checkpoint_interval"]
    probe = PROBE_STEPS - 1
    assert chosen["step"] == probe
    assert chosen["interval_s"] == pytest.approx((2 * chosen["save_s"] * chosen["mtbf_s"]) ** 0.5)
    assert chosen["steps"] == max(1, round(chosen["interval_s"] / chosen["step_s"]))
    saved = [e["step"] for e in events if e["type"] == "checkpoint"]
    assert saved == [probe, *range(probe + chosen["steps"], 23, chosen["steps"])]  # never after the last step


def test_an_automatic_interval_needs_a_positive_mtbf():
    validate(tiny_config(**{"fault.checkpoint_every": "auto"}))
    with pytest.raises(ConfigError, match="fault.mtbf_s"):
        validate(tiny_config(**{"fault.checkpoint_every": "auto", "fault.mtbf_s": 0.0}))
