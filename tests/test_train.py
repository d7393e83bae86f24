"""The trainer, in process (a group of one) and as real multi-process runs (gloo)."""
import json

import pytest
import torch

from labkit.launcher import launch
from labkit.metrics.steps import summarize
from labkit.train import train
from helpers import tiny_config

STEP_KEYS = {"step", "loss", "lr", "tokens_per_s", "step_time_s", "compute_s", "comm_s", "comm_frac", "tflops",
             "mfu", "max_mem_bytes"}


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def losses(run_dir):
    return [e["loss"] for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step"]


def test_single_process_run_writes_events_and_summary(tmp_path):
    summary = train(tiny_config(**{"run.eval_every": 3}), tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("step") == 6 and kinds.count("eval") == 2
    for e in (e for e in events if e["type"] == "step"):
        assert STEP_KEYS <= e.keys()
        assert e["step_time_s"] > 0 and 0 <= e["comm_frac"] < 1 and e["tflops"] > 0
        assert e["mfu"] is not None and 0 < e["mfu"] < 1  # measured CPU peak, per device
    assert summary["status"] == "finished" and summary["steps_completed"] == 6
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == losses(tmp_path)[-1]
    assert summary["entropy_floor"] == pytest.approx(1.4785, abs=1e-3)
    assert summary["val_floor"] == pytest.approx(1.4785, abs=0.15)  # the chain's loss on the scored tokens
    assert summary["val_floor"] != summary["entropy_floor"] and events[0]["val_floor"] == summary["val_floor"]


def test_training_lowers_the_loss(tmp_path):
    summary = train(tiny_config(**{"run.steps": 30, "optim.lr": 1e-2}), tmp_path)
    curve = losses(tmp_path)
    assert sum(curve[-5:]) / 5 < curve[0] - 0.3
    # the summary's running averages are the averages of the written steps, less the warm-up ones
    steps = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "step"]
    want = summarize(steps, skip=3)
    assert all(summary[key] == pytest.approx(want[key], rel=1e-12) for key in want if want[key] is not None)
    parts = summary["bookkeeping_s_per_step"]
    assert ({"events", "gather", "memory accounting", "step timing"} <= parts.keys()
            and all(v >= 0 for v in parts.values()))


def test_cpu_run_is_bitwise_reproducible(tmp_path):
    train(tiny_config(), tmp_path / "a")
    train(tiny_config(), tmp_path / "b")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a, b = (torch.load(tmp_path / d / "final_model.pt", weights_only=True) for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    train(tiny_config(**{"data.micro_batch_size": 8}), tmp_path / "full")
    train(tiny_config(**{"data.micro_batch_size": 2}), tmp_path / "accum")  # 4 micro-batches per step
    assert losses(tmp_path / "full") == pytest.approx(losses(tmp_path / "accum"), rel=1e-5)


def test_failed_run_keeps_its_data(tmp_path, monkeypatch):
    import labkit.train as t

    calls = {"n": 0}
    real_step = t.Trainer.step

    def crash_on_third(self, batches):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step(self, batches)

    monkeypatch.setattr(t.Trainer, "step", crash_on_third)
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_config(), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"] and summary["steps_completed"] == 2
    assert len(losses(tmp_path)) == 2
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
def test_two_process_ddp_equals_single_process_full_batch(tmp_path):
    """Real gloo processes: DDP over 2 ranks with half the batch each = 1 process with all of it."""
    cfg = tiny_config(**{"run.steps": 5})
    runs = {name: launch(cfg, nproc=int(name[1]), run_dir=tmp_path / name) for name in ("n1", "n2", "n2_again")}
    for run in runs.values():
        assert run.wait(timeout=120) == "finished", run.log()
    assert losses(tmp_path / "n2") == pytest.approx(losses(tmp_path / "n1"), rel=1e-5)
    assert losses(tmp_path / "n2") == losses(tmp_path / "n2_again")  # bitwise, across processes too
    one, two = (torch.load(tmp_path / f"n{n}" / "final_model.pt", weights_only=True) for n in (1, 2))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)
    start = read_jsonl(tmp_path / "n2" / "events.jsonl")[0]
    assert start["world_size"] == 2 and start["backend"] == "gloo"
    steps = [e for e in read_jsonl(tmp_path / "n2" / "events.jsonl") if e["type"] == "step"]
    assert all(e["comm_bytes"] > 0 and e["comm_s"] > 0 and len(e["rank_step_time_s"]) == 2 for e in steps)
