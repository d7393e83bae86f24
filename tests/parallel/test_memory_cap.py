"""The proof that no rank holds more than its part: a GPT whose training state does not fit a per-process memory
cap cannot train in one process, and trains under the same cap split over pp = 4 and over tp = 2 × pp = 2.

The cap, the model and the bounds are ``benchmarks/memory_cap.py``'s (which records the same numbers): the kernel's
``RLIMIT_DATA`` of 1.5 GiB on every process; 8 layers of width 1024 (1.61 GB of weights, gradients and Adam state in
one process). Every number compared comes from the kernel (``/proc/self/status``) or from labkit's prediction of a
rank's part (``labkit.parallel.reports.layout.rank_memory``, which also reads what the run's ranks held). Built the
old way (the whole model on every rank, then cut), each rank's start-up growth is ≥ 480 MB and this test fails.
"""
import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.multiproc
bench = load_benchmark("memory_cap")


def test_the_whole_model_cannot_train_in_one_process_under_the_cap(tmp_path):
    proc = bench.launch(tmp_path, 1, {})
    assert bench.out_of_memory(proc), proc.stderr[-3000:]
    events = tmp_path / "run" / "events.jsonl"
    assert not events.exists() or '"type": "step"' not in events.read_text()  # not one step
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.parametrize("layout", [{"pp": 4}, {"tp": 2, "pp": 2}], ids=["pp4", "tp2_pp2"])
def test_the_same_model_trains_under_the_same_cap_split_over_ranks(tmp_path, layout):
    proc = bench.launch(tmp_path, 4, layout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [line for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines() if '"type": "step"' in line]
    assert len(steps) == bench.MODEL["run.steps"]
    rows = bench.rank_rows(tmp_path, layout)
    assert len(rows) == 4
    for row in rows:
        assert row["whole_model_state_bytes"] > bench.CAP == row["data_limit_bytes"]  # each rank under the cap
        assert row["state_is_prediction"], row  # what it held: its part
        assert row["start_up_held"], row  # it built its part, not the whole
        assert row["run_held"], row
