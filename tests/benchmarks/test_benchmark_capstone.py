"""benchmarks/capstone.py's arithmetic on constructed rounds: a speed-up per round against that round's
baseline, the median and IQR only when every round counted, the reasons kept when one did not."""
import importlib.util

import pytest

from labkit.workshop import capstone
from labkit.workshop.exercises import repo_root

spec = importlib.util.spec_from_file_location("bench_capstone", repo_root() / "benchmarks" / "capstone.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
ATTEMPT = next(iter(capstone.REFERENCE_ATTEMPTS))


def record(step_s, final=2.0, tokens_per_s=1000.0):
    evals = capstone.eval_trajectory([(i, step_s) for i in range(120)],
                                     [(9 + 10 * k, 2.9 + (final - 2.9) * k / 11) for k in range(12)])
    return {"id": "x", "name": "capstone-x-1", "status": "finished", "tokens_per_s": tokens_per_s, "evals": evals,
            "config": {}, "world_size": 2, "load_1min_before": 0.5}


def test_each_round_is_judged_against_its_own_baseline():
    rounds = [{None: record(0.2), ATTEMPT: record(0.1, tokens_per_s=2000.0)} for _ in range(5)]
    rounds.append({None: record(0.3), ATTEMPT: record(0.1, tokens_per_s=3000.0)})
    row = bench.attempt_row(ATTEMPT, rounds)
    assert row["counted"] == 6 and row["rounds"] == pytest.approx([2.0] * 5 + [3.0])
    assert row["median"] == pytest.approx(2.0) and row["verdict"] == "faster"
    assert row["tokens_per_s_ratio"] == pytest.approx(2.0)


def test_a_round_that_does_not_count_leaves_no_speedup_and_keeps_its_reason():
    rounds = [{None: record(0.2), ATTEMPT: record(0.1)} for _ in range(5)]
    rounds.append({None: record(0.2), ATTEMPT: record(0.1, final=2.5)})
    row = bench.attempt_row(ATTEMPT, rounds)
    assert row["counted"] == 5 and row["median"] is None and row["verdict"] is None
    assert len(row["reasons"]) == 1 and "never reached" in row["reasons"][0]
    table = capstone.reference_table({"commit": "abcdef0", "machine": "a laptop", "settings": {"rounds": 6},
                                      "rows": [row]})
    assert "5 of 6" in table and "not every round counted: never reached" in table
