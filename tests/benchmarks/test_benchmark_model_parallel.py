"""benchmarks/model_parallel.py in its quick mode (a tiny model, one round): it runs, the bytes labkit's tensor
parallelism counted equal the analytic count on every step, and its results line holds every check.

Behaviour only: no timing target is asserted here (timings live in the benchmark's results, never in tests)."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("model_parallel")


def test_rounds_alternate_which_side_of_each_pair_runs_first(bench):
    variants = bench.variants_for(bench.NPROC)
    assert variants == ["tp_labkit", "tp_dtensor", "pp_labkit", "pp_torch"]
    assert bench.round_order(variants, 0) == variants
    assert bench.round_order(variants, 1) == ["tp_dtensor", "tp_labkit", "pp_torch", "pp_labkit"]


def test_the_pipeline_runs_m_equal_to_4p_and_tp_compares_on_the_same_dp_side(bench):
    from labkit.config import grad_accum_steps

    cfg = bench.bench_config("pp_labkit", bench.MODEL, 10)
    assert grad_accum_steps(cfg, bench.NPROC) == 4 * cfg.parallel.pp.degree == 16
    p2 = bench.bench_config("pp2_labkit", bench.MODEL, 10)
    assert grad_accum_steps(p2, bench.P2_NPROC) == 4 * p2.parallel.pp.degree == 8
    labkit, dtensor = (bench.bench_config(v, bench.MODEL, 10) for v in ("tp_labkit", "tp_dtensor"))
    assert labkit.replace(**{"parallel.tp.impl": "dtensor", "run.name": "tp_dtensor"}).to_dict() == dtensor.to_dict()


@pytest.mark.multiproc
def test_quick_mode_runs_and_records_every_check(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_parallel.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "LABKIT_RESULTS_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "model_parallel.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["benchmark"] == "model_parallel" and record["settings"]["quick"] is True
    assert {"cpu", "isa", "torch"} <= set(record["machine"])
    checks = {row["check"]: row for row in record["rows"]}
    assert set(checks) == {"tp step time", "pp step time", "bubble p=4", "bubble p=2", "tp bytes"}

    tp_bytes = checks["tp bytes"]  # exact, on every step, evaluations between steps included
    assert tp_bytes["held"] is True and tp_bytes["counted"] == [tp_bytes["analytic"]] and tp_bytes["steps"] == 4
    assert tp_bytes["evaluations_between"] >= 1
    assert tp_bytes["analytic"] == tp_bytes["micro_batches"] * tp_bytes["per_micro_batch"]["total"]
    assert tp_bytes["dtensor_counted"] == [None]  # DTensor's collectives run inside torch

    for axis in ("tp", "pp"):
        row = checks[f"{axis} step time"]
        for key in ("labkit_step_s", "torch_step_s", "ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (axis, key, row[key])
        assert row["ratio"] == pytest.approx(row["labkit_step_s"] / row["torch_step_s"])
        assert isinstance(row["held"], bool)
    for p, m in ((4, 16), (2, 8)):
        row = checks[f"bubble p={p}"]
        assert (row["p"], row["m"]) == (p, m) and row["ideal"] == pytest.approx((p - 1) / (m + p - 1))
        assert all(0 <= row[key] < 1 for key in ("measured", "timeline_bubble", "replayed_bubble"))
        assert isinstance(row["held"], bool)
        assert row["in_flight"] <= p  # 1F1B: at most p micro-batches' activations on a stage
    assert "tp bytes held" in record["notes"]


def schedule_event(p: int, m: int, durations) -> dict:
    """A step event whose gathered timeline is labkit's 1F1B order with ``durations(stage, kind)`` per span."""
    from labkit.parallel.pipeline import stage_order

    return {"rank_pipeline_timeline": [{"step_start": 0.0, "spans": [
        {"kind": kind, "mb": i, "start": 0.0, "end": durations(s, kind), "wait": 0.0}
        for kind, i in stage_order(p, m, "1f1b", s)]} for s in range(p)]}


def test_replaying_a_balanced_step_leaves_the_textbook_bubble(bench):
    from labkit.parallel.pipeline import ideal_bubble

    for p, m in ((4, 16), (2, 8), (4, 4)):
        event = schedule_event(p, m, lambda s, kind: 1.0 if kind == "F" else 2.0)
        assert bench.replayed_bubble(event) == pytest.approx(ideal_bubble(p, m))


def test_a_slower_stage_makes_the_others_wait_in_the_replay(bench):
    slow_last = schedule_event(4, 16, lambda s, kind: (1.0 if kind == "F" else 2.0) * (2 if s == 3 else 1))
    assert bench.replayed_bubble(slow_last) > (4 - 1) / (16 + 4 - 1) + 0.1
