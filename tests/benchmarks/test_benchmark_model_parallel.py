"""benchmarks/model_parallel.py in its quick mode (a tiny model, one round): it runs, the bytes labkit's tensor
parallelism counted equal the analytic count on every step, and its results line holds every check.

Behaviour only: no timing target is asserted here (timings live in the benchmark's results, never in tests)."""
import math
import os
import pathlib

import pytest

from helpers import load_benchmark, run_quick_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("model_parallel")


def test_rounds_alternate_which_side_of_each_pair_runs_first(bench):
    variants = bench.variants_for(bench.NPROC)
    assert variants == ["tp_labkit", "tp_dtensor", "pp4_labkit_1f1b", "pp4_torch_1f1b", "pp4_labkit_gpipe"]
    assert bench.round_order(variants, 0) == variants
    assert bench.round_order(variants, 1) == ["tp_dtensor", "tp_labkit", "pp4_torch_1f1b", "pp4_labkit_1f1b",
                                              "pp4_labkit_gpipe"]
    assert bench.variants_for(bench.P2_NPROC) == ["pp2_labkit_1f1b", "pp2_torch_1f1b", "pp2_labkit_gpipe"]


def test_the_pipeline_runs_m_equal_to_4p_and_tp_compares_on_the_same_dp_side(bench):
    from labkit.config import grad_accum_steps

    cfg = bench.bench_config("pp4_torch_1f1b", False, 10)
    assert grad_accum_steps(cfg, bench.NPROC) == 4 * cfg.parallel.pp.degree == 16
    assert (cfg.parallel.pp.impl, cfg.parallel.pp.schedule) == ("torch", "1f1b")
    p2 = bench.bench_config("pp2_labkit_gpipe", False, 10)
    assert grad_accum_steps(p2, bench.P2_NPROC) == 4 * p2.parallel.pp.degree == 8
    assert (p2.parallel.pp.impl, p2.parallel.pp.schedule) == ("labkit", "gpipe")
    assert p2.model.n_embd == cfg.model.n_embd == 256 and bench.bench_config("tp_labkit", False, 10).model.n_embd == 128
    labkit, dtensor = (bench.bench_config(v, False, 10) for v in ("tp_labkit", "tp_dtensor"))
    assert labkit.replace(**{"parallel.tp.impl": "dtensor", "run.name": "tp_dtensor"}).to_dict() == dtensor.to_dict()


@pytest.mark.multiproc
def test_quick_mode_runs_and_records_every_check(tmp_path, bench):
    _, records = run_quick_benchmark("model_parallel", tmp_path, timeout=600)
    assert len(records) == 1
    record = records[0]
    assert record["benchmark"] == "model_parallel" and record["settings"]["quick"] is True
    assert {"cpu", "isa", "torch"} <= set(record["machine"])
    checks = {row["check"]: row for row in record["rows"]}
    bubbles = {f"bubble p={p} {pipeline}" for p in (2, 4) for pipeline in bench.PIPELINES}
    assert set(checks) == {"tp step time", "pp step time", "tp bytes"} | bubbles

    tp_bytes = checks["tp bytes"]  # exact, on every step, evaluations between steps included
    assert tp_bytes["held"] is True and tp_bytes["counted"] == [tp_bytes["analytic"]] and tp_bytes["steps"] == 4
    assert tp_bytes["evaluations_between"] >= 1
    assert tp_bytes["analytic"] == tp_bytes["micro_batches"] * tp_bytes["per_micro_batch"]["total"]
    assert tp_bytes["dtensor_counted"] == [None]  # DTensor's collectives run inside torch

    for axis in ("tp", "pp"):
        row = checks[f"{axis} step time"]
        for key in ("labkit_step_s", "torch_step_s", "ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (axis, key, row[key])
        assert row["ratio_of_medians"] == pytest.approx(row["labkit_step_s"] / row["torch_step_s"])
        assert row["round_ratios"] == [row["ratio"]] and row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]
        assert row["held"] is False  # one round is not a measurement to quote (6 at least)
    for name in bubbles:
        row = checks[name]
        p, m = row["p"], row["m"]
        assert m == 4 * p and row["ideal"] == pytest.approx((p - 1) / (m + p - 1))
        for key in ("measured", "timeline_bubble", "replayed_bubble", "replayed_wall_bubble"):
            assert 0 <= row[key] < 1, (name, key)
        assert row["replayed_wall_bubble"] <= row["timeline_bubble"] + 1e-9  # a replay never waits longer
        assert len(row["measured_rounds"]) == len(row["replayed_rounds"]) == 1
        assert [s["n_blocks"] for s in row["partition"]] == [4 // p] * p  # 4 blocks, a light head: even
        assert isinstance(row["held"], bool) and row["live_held"] in ((None,) if p > os.cpu_count() else (True, False))
        if "labkit" in name:  # labkit's schedule counts what it holds: 1F1B at most p − stage, GPipe all m
            assert row["in_flight"] == (p if "1f1b" in name else m)
    assert "tp bytes held" in record["notes"]


def schedule_event(p: int, m: int, durations) -> dict:
    """A step event whose gathered timeline is labkit's 1F1B order with ``durations(stage, kind)`` per span."""
    from labkit.parallel.pp.pipeline import stage_order

    return {"rank_pipeline_timeline": [{"step_start": 0.0, "spans": [
        {"kind": kind, "mb": i, "start": 0.0, "end": durations(s, kind), "wait": 0.0, "cpu": durations(s, kind)}
        for kind, i in stage_order(p, m, "1f1b", s)]} for s in range(p)]}


def test_replaying_a_balanced_step_leaves_the_textbook_bubble(bench):
    from labkit.parallel.pp.pipeline import ideal_bubble

    for p, m in ((4, 16), (2, 8), (4, 4)):
        event = schedule_event(p, m, lambda s, kind: 1.0 if kind == "F" else 2.0)
        assert bench.replayed(event, "cpu") == pytest.approx(ideal_bubble(p, m))


def test_a_slower_stage_makes_the_others_wait_in_the_replay(bench):
    slow_last = schedule_event(4, 16, lambda s, kind: (1.0 if kind == "F" else 2.0) * (2 if s == 3 else 1))
    assert bench.replayed(slow_last, "wall") > (4 - 1) / (16 + 4 - 1) + 0.1
