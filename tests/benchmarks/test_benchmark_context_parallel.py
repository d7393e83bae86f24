"""benchmarks/context_parallel.py: its pure parts (the rotation, the per-case reading of the ranks' rows) and its
quick mode on real gloo groups (cp = 2 and 4): every case's counted bytes and kept activations equal the formulas
and the line is written. Behaviour only: no timing is asserted (timings live in the results file)."""
import pytest

from helpers import load_benchmark, run_quick_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("context_parallel")


def test_each_case_takes_every_place_in_the_order(bench):
    items = bench.cases()
    assert len(items) == 6 and ("ring", "head_tail") in items
    firsts = {bench.round_order(items, r)[0] for r in range(len(items))}
    assert firsts == set(items)


def test_a_round_reads_as_the_slowest_ranks_median_call(bench):
    def row(walls, cpu):
        return {"round": 0, "variant": "ring", "layout": "head_tail",
                "calls": [{"wall_s": w, "cpu_s": cpu, "bytes": {"forward": 8, "backward": 24}, "block_bytes": 4,
                           "saved_bytes": 20, "lse_bytes": 4}
                          for w in walls]}
    found = bench.per_case([[row([1.0, 3.0, 2.0], 1.0)], [row([5.0, 4.0, 6.0], 3.0)]])
    (entry,) = found[("ring", "head_tail")]
    assert entry["wall_s"] == 5.0 and entry["rank_cpu_s"] == [1.0, 3.0]
    assert bench.max_over_mean(entry["rank_cpu_s"]) == 1.5


@pytest.mark.multiproc
def test_quick_mode_counts_every_cases_bytes_as_the_formula(tmp_path):
    _, (record,) = run_quick_benchmark("context_parallel", tmp_path, timeout=600)
    rows = record["rows"]
    assert {(r["cp"], r["variant"], r["layout"]) for r in rows} == {
        (cp, v, layout) for cp in (2, 4) for v in ("ring", "allgather", "ulysses")
        for layout in ("contiguous", "head_tail")}
    assert all(r["bytes_held"] for r in rows)
    assert all(r["saved_held"] for r in rows)  # activations kept for backward, counted at autograd's hooks
    assert {(r["cp"], r["saved_fraction"]) for r in rows if r["variant"] != "allgather"} == {(2, 0.5), (4, 0.25)}
    assert {r["imbalance_counted"] for r in rows
            if r["variant"] == "ring" and r["layout"] == "contiguous"} == {1.5, 1.75}
