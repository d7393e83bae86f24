"""benchmarks/data_parallel.py in its quick mode (a tiny model, one round): it runs every strategy, records its
table and its checks, and the checks that are arithmetic hold there too: ZeRO-1 and ZeRO-2 send exactly DDP's bytes.

Behaviour only: no timing target is asserted here (timings live in the benchmark's results, never in tests)."""
import pathlib

import pytest

from helpers import load_benchmark, run_quick_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_variant_takes_each_place_in_the_rotation():
    bench = load_benchmark("data_parallel")
    orders = [bench.round_order(r) for r in range(len(bench.VARIANTS))]
    assert all(sorted(order) == sorted(bench.VARIANTS) for order in orders)
    assert {order[0] for order in orders} == set(bench.VARIANTS)
    grad = bench.overrides("zero2_grad", 4)
    assert grad["parallel.dp.strategy"] == "zero2" and grad["parallel.dp.bucket_mb"] == 2.0
    assert (grad["data.micro_batch_size"], grad["model.block_size"]) == (1, 8)  # activations small beside Ψ/p


@pytest.mark.multiproc
def test_quick_mode_runs_and_records_every_check(tmp_path):
    _, (table, checks) = run_quick_benchmark("data_parallel", tmp_path)
    assert table["table"] == "data_parallel" and checks["table"] == "checks" and table["settings"]["quick"] is True
    rows = {row["variant"]: row for row in table["rows"]}
    assert set(rows) == {"torch_ddp", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "zero3", "fsdp2", "zero2_grad"}
    for variant, row in rows.items():  # the tracked step's peaks hold at least what the rank keeps throughout
        assert row["peak_forward"] >= row["param"] + row["opt"], variant
        assert row["peak_optimizer"] >= row["param"] + row["opt"], variant
    assert rows["zero2"]["grad_peak"] is not None and rows["ddp_naive"]["grad_peak"] is None
    assert all(row["growth_backward"] is not None and row["growth_backward"] > 0 for row in rows.values())
    found = {c["check"]: c for c in checks["rows"]}
    assert found["zero1 bytes = DDP bytes"]["held"] and found["zero2 bytes = DDP bytes"]["held"]
    assert len(found) == 8 and all(isinstance(c["held"], bool) for c in found.values())
    for check in ("zero1 / torch_ddp", "zero2 / torch_ddp", "zero3 / fsdp2"):  # one round is not a measurement to
        ratio = found[f"{check} step time"]  # quote (6 at least): not held
        assert len(ratio["rounds"]) == 1 and ratio["held"] is False
    grad = found["zero2 peak gradient bytes ≈ Ψ/p + one bucket (allocation tracker)"]
    assert grad["value"] == rows["zero2_grad"]["growth_backward"] and grad["largest_param_bytes"] < grad["bucket"]
