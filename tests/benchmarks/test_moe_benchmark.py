"""benchmarks/moe.py (issue 37) in its quick mode, in this process (labkit's trainer runs one process here, no worker
starts): every part records every round and every seed, its verdicts follow the rounds rule, and the checks that are
arithmetic hold — the two expert paths agree, the MoE GPT's active FLOPs match the dense one's, every overloaded start
is overloaded.

Behaviour only: no timing target is asserted here (timings live in the benchmark's results, never in tests)."""
import json

import pytest

from helpers import load_benchmark
from labkit.rounds import MIN_ROUNDS, verdict


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("moe")


@pytest.fixture(scope="module")
def tables(bench, tmp_path_factory):
    """The quick run's tables by name (the whole benchmark, once for this module)."""
    results = tmp_path_factory.mktemp("moe-results")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LABKIT_RESULTS_DIR", str(results))
        bench.main(["--quick"])
    records = [json.loads(line) for line in (results / "moe.jsonl").read_text().splitlines()]
    assert all(r["benchmark"] == "moe" and r["settings"]["quick"] and r["machine"]["cpu"] for r in records)
    return {r["table"]: r for r in records}


def test_the_two_sides_alternate_which_goes_first(bench):
    assert [bench.round_order(r, ("a", "b")) for r in range(3)] == [("a", "b"), ("b", "a"), ("a", "b")]


def assert_rounds_rule(summary: dict, rounds: list[float], lower_is_faster: bool) -> None:
    """Every round in the summary, its quartiles around its median, its verdict the IQR's."""
    assert summary["rounds"] == rounds and summary["n_rounds"] == len(rounds)
    assert summary["q1"] <= summary["median"] <= summary["q3"]
    assert summary["verdict"] == verdict(summary["q1"], summary["q3"], lower_is_faster)
    assert summary["enough_rounds"] == (len(rounds) >= MIN_ROUNDS)


def test_grouped_against_loop_keeps_every_round_and_says_which_path_ran(tables):
    rounds, (summary,) = tables["grouped_rounds"]["rows"], tables["grouped"]["rows"]
    assert [row["round"] for row in rounds] == list(range(1, MIN_ROUNDS + 1))
    assert [row["first"] for row in rounds[:2]] == ["loop", "grouped"]
    assert all(row["grouped_vs_loop"] == pytest.approx(row["grouped_s"] / row["loop_s"]) for row in rounds)
    assert_rounds_rule(summary, [row["grouped_vs_loop"] for row in rounds], lower_is_faster=True)
    assert summary["loop_path"] == "loop" and summary["grouped_path"] in ("grouped_mm", "grouped_split")
    assert summary["paths_agree"] and summary["cpu"]


def test_dense_against_moe_match_active_flops_and_record_each_rounds_speed_and_loss(tables):
    rounds, record = tables["dense_rounds"]["rows"], tables["dense"]
    flops, speed, dense, moe = record["rows"]
    assert flops["held"] and flops["moe_params"]["active"] < flops["moe_params"]["total"]
    assert flops["dense_params"]["active"] == flops["dense_params"]["total"]
    assert_rounds_rule(speed, [row["moe_vs_dense"] for row in rounds], lower_is_faster=False)
    assert len(rounds) == record["settings"]["size"]["dense_rounds"]
    for row, name in ((dense, "dense"), (moe, "moe")):
        assert row["model"] == name and len(row["val_loss_rounds"]) == len(rounds)
        assert row["val_loss_rounds"] == [r[f"{name}_val_loss"] for r in rounds]


def test_steps_to_balance_keeps_every_seed_and_never_counts_past_the_bound(tables):
    runs, record = tables["balance_runs"]["rows"], tables["balance"]
    settings = record["settings"]
    methods = ["loss_free"] + [f"aux_loss alpha={a:g}" for a in settings["aux_alphas"]]
    assert [(r["method"], r["seed"]) for r in runs] == [(m, s) for m in methods for s in settings["seeds"]]
    assert all(r["overloaded"] and r["start_max_mean"] >= 2 for r in runs)  # the start is measured, and overloaded
    for run in runs:
        count = run["steps_to_balance"]
        assert run["reached"] == (count is not None) and (count is None or 0 <= count < run["bound"])
    for row, method in zip(record["rows"], methods):
        mine = [r for r in runs if r["method"] == method]
        assert row["method"] == method and row["steps"] == [r["steps_to_balance"] for r in mine]
        assert row["bound_hit"] == row["at_least"] == any(r["steps_to_balance"] is None for r in mine)
        assert row["q1"] <= row["median"] <= row["q3"] <= row["bound"]
        assert 1 < row["chance_max_mean"] < 2


def test_steps_to_balance_counts_the_updates_before_the_first_balanced_step(bench):
    steps = [{"moe_max_mean": [1.0, m]} for m in (3.8, 1.4, 1.09, 1.3)]
    assert bench.steps_to_balance(steps) == 2 and bench.steps_to_balance(steps[:2]) is None
    runs = [{"seed": s, "steps_to_balance": c, "start_max_mean": 3.0, "overloaded": True, "lm_loss_last10": 1.0,
             "share_balanced_after": None, "median_max_mean_last100": 1.2} for s, c in enumerate([10, None, 30])]
    row = bench.steps_summary("x", runs, bound=50, chance=1.05)
    assert row["steps"] == [10, None, 30] and row["reached"] == 2 and row["at_least"]  # the bound counts as 50
    assert (row["q1"], row["median"], row["q3"]) == (20, 30, 40)


def test_the_balanced_expert_parallel_bytes_follow_the_formula(bench):
    """2·k·T·d·(ep − 1)/ep fp32 values per layer and micro-batch each way (dispatch + combine), and the counts."""
    cfg = bench.ep_config(bench.QUICK, 2, 8)  # 1 MoE layer, 1 micro-batch per rank of 2 × 16 tokens, d 32, k 2, E 4
    assert bench.balanced_ep_bytes(cfg, 2) == 2 * 2 * 2 * 32 * (1 / 2) * 32 * 4 + 8 * 4 / 2
    assert bench.balanced_ep_bytes(cfg, 1) == 0


def test_the_calibrated_model_beside_the_ep_runs_is_modelled_from_the_shipped_calibration(bench):
    cfg = bench.ep_config(bench.FULL, 2, 30)
    balanced, skewed = bench.modelled_ep_step(cfg, 1.0), bench.modelled_ep_step(cfg, 1.5)
    assert 0 < balanced["modelled_all_to_all_s"] < skewed["modelled_all_to_all_s"] < skewed["modelled_step_s"]
    assert bench.modelled_ep_step(bench.ep_config(bench.FULL, 1, 30), 1.5)["modelled_all_to_all_s"] == 0
    assert balanced["calibration"]["commit"]  # which calibration: the newest full one in the results file


def test_the_ep_summary_reads_every_round_of_each_degree(bench, monkeypatch):
    """Part 4's bookkeeping on stand-in runs (its launches are the measurement: not run here)."""
    runs = {ep: {"step_s": 0.03 * (1 + ep / 4), "all_to_all_s": 0.01 * (ep - 1), "all_to_all_frac": 0.1 * (ep - 1),
                 "ep_bytes_per_step": 1000 * (ep - 1), "max_mean": 1.2,
                 "rank_max_mean": 1.1} for ep in (1, 2, 4)}
    monkeypatch.setattr(bench, "ep_run", lambda cfg: runs[cfg.parallel.ep.degree])
    rows, summary = bench.expert_parallel_step_times(bench.QUICK, 6, 8)
    assert [row["round"] for row in rows] == list(range(1, 7)) and {tuple(row["order"]) for row in rows} == {
        (1, 2, 4), (2, 4, 1), (4, 1, 2)}
    ep2 = summary[0]
    assert ep2["rounds"] == [runs[2]["step_s"] / runs[1]["step_s"]] * 6 and ep2["bytes_per_step_counted"] == 1000
    assert ep2["counted_vs_formula"] == 1000 / ep2["bytes_per_step_balanced_formula"]
    assert ep2["modelled_vs_measured_all_to_all"] == ep2["modelled_all_to_all_s"] / runs[2]["all_to_all_s"]
