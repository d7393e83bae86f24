"""benchmarks/dashboard_cost.py: the same run with and without a dashboard following it, interleaved, recorded.

Behaviour only: no timing target is asserted here (timings live in the benchmark's results, never in tests)."""
import json
import sys

import pytest

from helpers import load_benchmark


def test_the_variants_alternate_which_goes_first():
    bench = load_benchmark("dashboard_cost")
    assert [bench.round_order(r) for r in range(3)] == [("bare", "dashboard"), ("dashboard", "bare"),
                                                        ("bare", "dashboard")]


def test_steps_beside_a_redraw_are_compared_with_the_others_by_their_median_speed():
    bench = load_benchmark("dashboard_cost")
    times = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # the step ending at 7 took 2 s: it overlapped a redraw
    events = [{"type": "step", "step": i, "time": float(t)} for i, t in enumerate(times)]
    assert bench.overlap_ratio(events, [(5.5, 6.5)]) == pytest.approx(0.5)
    assert bench.overlap_ratio(events, []) is None  # no redraw: nothing to compare


@pytest.mark.multiproc
def test_quick_mode_runs_both_variants_and_records_the_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["dashboard_cost.py", "--quick"])
    load_benchmark("dashboard_cost").main()  # in this process: the dashboard draws here, the runs' workers apart
    printed = capsys.readouterr().out
    record, = (json.loads(line) for line in (tmp_path / "dashboard_cost.jsonl").read_text().splitlines())
    assert record["table"] == "dashboard_cost" and record["settings"]["quick"] is True and record["machine"]
    rows = {row["variant"]: row for row in record["rows"]}
    assert set(rows) == {"bare", "dashboard"} and all(row["tokens_per_s"] > 0 for row in rows.values())
    assert all(isinstance(row["load_1min_before"], float) for row in rows.values())
    dash = rows["dashboard"]
    assert dash["frames"] >= 1 and dash["live_draw_cpu_s"] + dash["last_frame_cpu_s"] > 0  # it drew, and says
    assert dash["follow_cpu_s"] > 0 and dash["live_frames"] <= dash["frames"]  # what that and following cost
    ratio = rows["dashboard"]["tokens_per_s"] / rows["bare"]["tokens_per_s"]
    assert record["settings"]["ratio_median"] == pytest.approx(ratio) and "throughput ratio" in printed
