"""Notebook 12's logic: the modelled memory and the cp it forces, the sentences read off a lab record, and the lab's
real run on cp gloo processes started through torchrun."""
import pytest

from labkit.memory_estimate import activation_bytes_per_layer
from labkit.context_lab import run_lab
from labkit.parallel.cp.volume import cp_wire_bytes
from labkit.widgets import context_parallel as lab12

from lab_data import cp_lab


def test_each_rank_of_cp_keeps_a_cp_th_of_the_activations():
    for recompute in ("none", "selective", "full"):
        one = activation_bytes_per_layer(8192, 2, 1024, 16, recompute=recompute)
        assert activation_bytes_per_layer(8192, 2, 1024, 16, recompute=recompute, cp=4) == one / 4
    assert lab12.activation_gib(2**16, 8) == lab12.activation_gib(2**16, 1) / 8
    with pytest.raises(ValueError, match="cp must be >= 1"):
        activation_bytes_per_layer(8192, 2, 1024, 16, cp=0)


def test_the_cp_a_sequence_needs_is_the_smallest_that_fits_and_none_past_the_largest():
    need = lab12.cp_needed(2**16, 40.0)
    assert lab12.activation_gib(2**16, need) <= 40.0 < lab12.activation_gib(2**16, need // 2)
    assert lab12.cp_needed(2**12, 1e6) == 1
    assert lab12.cp_needed(2**20, 40.0) is None
    assert "even cp = 16 leaves" in lab12.memory_text(2**20, 40.0) and "modelled" in lab12.memory_text(2**20, 40.0)
    assert f"cp = {need} is the smallest degree" in lab12.memory_text(2**16, 40.0)


def test_the_imbalance_rows_put_the_counted_work_beside_the_measured_cpu_seconds():
    rows = lab12.imbalance_rows(cp_lab(4))
    contiguous = [r["counted"] for r in rows if r["layout"] == "contiguous"]
    assert contiguous == pytest.approx([0.25, 0.75, 1.25, 1.75])  # 1 : 3 : 5 : 7 of the mean 4
    assert all(r["counted"] == pytest.approx(1.0) for r in rows if r["layout"] == "head_tail")
    measured = [r["measured"] for r in rows if r["layout"] == "contiguous"]
    assert measured == pytest.approx([0.4, 0.8, 1.2, 1.6])  # the record's CPU seconds 1 : 2 : 3 : 4


def test_the_lines_say_what_the_record_says():
    record = cp_lab(2)
    assert all("equal on every rank" in line for line in lab12.bytes_lines(record))
    record["checks"]["ulysses"][1] = {**record["checks"]["ulysses"][1], "bytes": {"forward": 1, "backward": 2}}
    assert "NOT equal" in lab12.bytes_lines(record)[2]
    assert all("equal to one rank" in line for line in lab12.check_lines(record))
    assert "12.0 ms median (1.09× the ring's) — rounds: 12.0, 13.0, 11.0 ms" in lab12.times_lines(record)[1]
    assert "CAUGHT" in lab12.bug_text(record, "stale_kv")
    record["bugs"]["stale_kv"] = record["checks"]["ring"]
    assert "not caught" in lab12.bug_text(record, "stale_kv")


@pytest.mark.parametrize("cp, seq", [(1, 64), (2, 66)])
def test_a_lab_that_cannot_run_is_refused_before_any_worker(cp, seq):
    with pytest.raises(ValueError, match="cp >= 2|does not cut into"):
        run_lab(cp, seq)


@pytest.mark.multiproc
def test_the_lab_run_checks_every_variant_catches_every_bug_and_counts_the_formulas_bytes():
    lab = run_lab(cp=2, seq=64, rounds=2)
    assert lab["cp"] == 2 and set(lab["checks"]) == {"ring", "allgather", "ulysses"}
    for variant, ranks in lab["checks"].items():
        assert all(r["ok"] for r in ranks), variant
        assert all(r["bytes"] == r["expected"] == cp_wire_bytes(variant, 2, r["block_bytes"]) for r in ranks), variant
    assert all(not all(r["ok"] for r in ranks) for ranks in lab["bugs"].values())  # each bug caught
    for layout, timelines in lab["timelines"].items():  # every rank met every block once, round the ring
        assert [sorted(s["block"] for s in steps) for steps in timelines] == [[0, 1], [0, 1]], layout
        assert all(s["compute_s"] > 0 and s["wait_s"] >= 0 for steps in timelines for s in steps), layout
    assert {v: len(t) for v, t in lab["rounds_s"].items()} == {"ring": 2, "allgather": 2, "ulysses": 2}
    assert all(s > 0 for seconds in lab["cpu_s"].values() for s in seconds)
