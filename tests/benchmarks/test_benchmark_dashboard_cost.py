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


def test_the_browser_rounds_put_every_variant_in_every_place_equally_often_over_six_rounds():
    bench = load_benchmark("dashboard_cost")
    orders = [bench.browser_order(r) for r in range(12)]
    assert all(sorted(order) == sorted(bench.BROWSER_VARIANTS) for order in orders)
    for place in range(3):
        assert sorted(order[place] for order in orders[:6]) == sorted(bench.BROWSER_VARIANTS * 2)
    assert orders[6:] == orders[:6] and bench.DEFAULT_BROWSER_ROUNDS % 6 == 0
    assert bench.DEFAULT_BROWSER_ROUNDS >= bench.BROWSER_ROUNDS


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


def browser_rows(ratios: list[float], gaps: list[list[float]], controls: list[float] = ()) -> list[dict]:
    """Rounds as the --browser mode records them: bare at 100 tokens/s, the dashboard at ratio × that (and the
    control, bare again, at control × that, where given)."""
    bench = load_benchmark("dashboard_cost")
    rows = []
    for r, (ratio, round_gaps) in enumerate(zip(ratios, gaps)):
        rows.append({"round": r + 1, "variant": "bare", "tokens_per_s": 100.0})
        frames = bench.frames_row({"launched": 0.0, "run_end": 10.0},
                                  [{"loaded": 1000 * t, "chars": 1} for t in round_gaps])
        rows.append({"round": r + 1, "variant": "dashboard", "tokens_per_s": 100.0 * ratio, **frames})
        if controls:
            rows.append({"round": r + 1, "variant": "bare again", "tokens_per_s": 100.0 * controls[r]})
    return rows


def test_the_page_frames_gaps_run_from_the_first_frame_to_the_runs_end():
    bench = load_benchmark("dashboard_cost")
    run = {"launched": 100.0, "run_end": 110.0}
    row = bench.frames_row(run, [{"loaded": 1000 * t, "chars": 9} for t in (104.0, 106.5, 109.0, 111.0)])
    assert row["live_frames"] == 3 and row["frames_received"] == 4  # the last one came after the run: not live
    assert row["gaps_s"] == pytest.approx([2.5, 2.5, 1.0]) and row["frames_held"]
    assert row["first_frame_after_launch_s"] == pytest.approx(4.0)
    late = bench.frames_row(run, [{"loaded": 1000 * t, "chars": 9} for t in (104.0, 108.0)])
    assert late["max_gap_s"] == pytest.approx(4.0) and not late["frames_held"]  # 4 s without a frame
    none = bench.frames_row(run, [])
    assert none["live_frames"] == 0 and none["max_gap_s"] is None and not none["frames_held"]


def test_the_browser_summary_pairs_each_round_and_holds_only_with_enough_rounds_above_the_target():
    bench = load_benchmark("dashboard_cost")
    steady = [[2.0, 4.0, 6.0, 8.0]] * bench.BROWSER_ROUNDS
    good = bench.browser_summary(browser_rows([0.99, 1.0, 0.98, 1.01] * 5, steady))
    assert good["ratio"]["n_rounds"] == bench.BROWSER_ROUNDS and good["held_cost"] and good["held_frames"]
    assert good["ratio_ci95"][0] <= good["ratio_median"] <= good["ratio_ci95"][1]
    costly = bench.browser_summary(browser_rows([0.9, 0.95, 0.93, 0.99] * 5, steady))
    assert not costly["held_cost"]
    few = bench.browser_summary(browser_rows([1.0, 1.0], steady[:2]))
    assert not few["held_cost"]  # above the target, but fewer rounds than asked for
    gappy = bench.browser_summary(browser_rows([1.0] * 20, [[2.0, 6.0]] * 20))
    assert not gappy["held_frames"] and gappy["max_gap_s"] == pytest.approx(4.0)


def test_the_benchmarks_notebook_is_one_empty_code_cell_with_an_id():
    nb = json.loads(load_benchmark("dashboard_cost").notebook_json())
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] == 5
    cell, = nb["cells"]
    assert cell["cell_type"] == "code" and cell["id"] and cell["source"] == ""


def test_the_control_says_whether_the_machines_noise_lets_the_protocol_resolve_the_target():
    bench = load_benchmark("dashboard_cost")
    steady = [[2.0, 4.0, 6.0, 8.0]] * bench.BROWSER_ROUNDS
    quiet = bench.browser_summary(browser_rows([0.99] * 20, steady, [1.0, 1.01, 0.99, 1.0] * 5))
    assert quiet["control"]["resolvable"] and quiet["control"]["of"] == "bare again / bare"
    assert quiet["control"]["ratio_median"] == pytest.approx(1.0)
    noisy = bench.browser_summary(browser_rows([0.99] * 20, steady, [0.9, 1.1, 0.93, 1.05] * 5))
    assert not noisy["control"]["resolvable"] and noisy["held_cost"]  # the control judges the machine, not the cost
    assert "control" not in bench.browser_summary(browser_rows([0.99] * 20, steady))  # rounds without one
