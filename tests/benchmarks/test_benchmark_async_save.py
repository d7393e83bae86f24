"""benchmarks/async_save.py: every round kept with both saves, the verdict from the rounds' IQR, the summary's
medians from the rounds (structure only: no timing is asserted)."""
import statistics

import pytest

from helpers import run_quick_benchmark


@pytest.mark.multiproc
def test_the_quick_run_keeps_every_round_and_summarises_them(tmp_path):
    out, records = run_quick_benchmark("async_save", tmp_path)
    rounds, (summary,) = (next(r["rows"] for r in records if r["table"] == t) for t in ("async_save_rounds",
                                                                                           "async_save"))
    assert [r["round"] for r in rounds] == list(range(1, 7)) and {r["first"] for r in rounds} == {"sync", "async"}
    assert summary["rounds"] == [r["async_vs_sync_blocked"] for r in rounds]
    assert summary["q1"] <= summary["median"] <= summary["q3"]
    assert (summary["verdict"] == "faster") == (summary["q3"] < 1) and "async/sync blocked" in out
    assert summary["async_blocked_s"] == statistics.median(r["async_blocked_s"] for r in rounds)
    assert all(r["async_total_s"] > 0 and r["sync_bytes_on_disk"] > 0 for r in rounds)
