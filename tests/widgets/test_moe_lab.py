"""Notebook 13's logic: the routing counted in this process, the drop formula, the lab's layout and runs' config, the
bytes formula of the all-to-all, what the pictures and sentences read off the runs' events and off the results file,
the dashboard following a MoE run with its own picture, and the lab's real runs on 2 gloo processes."""
import json

import pytest

import labkit
from helpers import processes_mentioning
from labkit.model.moe import expert_capacity
from labkit.moe_lab import (ARMS, balance_benchmark, balance_rows, balance_runs, balanced_drop, balanced_ep_bytes,
                            dense_trade, drop_curve, ep_benchmark, ep_record, ep_run, lab_config, lab_layout, route)
from labkit.text import too_wide
from labkit.widgets import moe as lab13
from labkit.widgets import moe_panels as panels

from lab_data import moe_events


# ---------------------------------------------------------------- routing in this process


@pytest.mark.parametrize("experts, top_k, factor", [(8, 2, 1.25), (4, 1, 0.5), (16, 2, 1.0), (8, 2, None)])
def test_a_routing_counts_every_assignment_once_and_drops_only_over_capacity(experts, top_k, factor):
    routed = route(experts, top_k, factor, skew=2.0)
    assert sum(routed["load"]) == top_k * routed["tokens"]
    assert [k + d for k, d in zip(routed["kept"], routed["dropped"])] == routed["load"]
    assert routed["capacity"] == expert_capacity(routed["tokens"], experts, top_k, factor)
    if factor is None:
        assert routed["dropped"] == [0] * experts and routed["drop_share"] == 0.0
    else:
        assert all(k <= routed["capacity"] for k in routed["kept"])
        assert routed["dropped"] == [max(0, n - routed["capacity"]) for n in routed["load"]]  # first come first served
    assert routed["drop_share"] == pytest.approx(sum(routed["dropped"]) / (top_k * routed["tokens"]))
    assert routed["max_mean"] == pytest.approx(max(routed["load"]) / (top_k * routed["tokens"] / experts))


def test_raising_expert_0s_logit_overloads_it_and_the_loss_free_bias_evens_it_out():
    even, skewed = route(skew=0.0), route(skew=3.0)
    assert skewed["load"][0] > even["load"][0] and skewed["max_mean"] > even["max_mean"]
    assert skewed["aux_loss"] > even["aux_loss"]  # the Switch loss grows with the concentration
    biased = route(skew=3.0, bias_steps=200)
    assert biased["max_mean"] < skewed["max_mean"] and biased["drop_share"] < skewed["drop_share"]
    assert biased["bias"][0] == min(biased["bias"]) and sum(biased["bias"]) == pytest.approx(0.0, abs=1e-6)
    assert route(skew=3.0)["bias"] == [0.0] * 8  # no moves: no bias
    assert route(skew=1.0, seed=3) == route(skew=1.0, seed=3)  # seeded: the same routing every time


def test_the_balanced_formula_and_what_a_routing_drops_at_each_factor():
    assert balanced_drop(512, 8, 2, 0.5) == pytest.approx(0.5)
    assert balanced_drop(512, 8, 2, 0.25) == pytest.approx(0.75)
    assert balanced_drop(512, 8, 2, 1.0) == balanced_drop(512, 8, 2, 3.0) == balanced_drop(512, 8, 2, None) == 0.0
    for skew in (0.0, 2.0):
        rows = drop_curve(skew)
        measured = [r["measured"] for r in rows]
        assert measured == sorted(measured, reverse=True)  # more room never drops more
        # Σ max(0, loadᵢ − C) ≥ max(0, k·T − E·C): no routing drops less than the even one
        assert all(r["measured"] >= r["balanced_formula"] - 1e-12 for r in rows)
    assert drop_curve(2.0)[4]["measured"] > drop_curve(0.0)[4]["measured"]  # at 1.25, the skewed router drops more


# ---------------------------------------------------------------- the layout, the config, the bytes formula


@pytest.mark.parametrize("cores, nproc", [(1, 2), (2, 2), (3, 2), (4, 4), (16, 4)])
def test_the_lab_says_how_many_processes_it_chose_for_the_cores_it_found(cores, nproc):
    layout = lab_layout(cores)
    assert layout["nproc"] == layout["ep"] == nproc and f"{cores} CPU core" in layout["why"]
    assert ("take turns" in layout["why"]) == (cores < nproc)


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_lab_config_is_valid_on_the_lab_s_processes(nproc):
    for quick in (True, False):
        cfg = lab_config(quick)
        for arm in ARMS:
            labkit.validate(cfg.replace(**{"model.moe.balance": arm}), nproc=nproc)
        labkit.validate(cfg.replace(**{"parallel.ep.degree": nproc}), nproc=nproc)
    assert lab_config(True).run.steps < lab_config(False).run.steps


def test_the_balanced_all_to_all_bytes_by_hand():
    cfg = lab_config(True)  # 2 MoE layers, d 64, top-2 of 8, 16 sequences of 64 tokens, micro-batches of 4
    # 2 processes: 2 micro-batches of 256 tokens each; per layer and micro-batch 4·k·T/2 rows of 64 fp32 + 4 counts
    assert balanced_ep_bytes(cfg, 2, 2) == 2 * 2 * (4 * 2 * 256 / 2 * 64 * 4 + 8 * 8 / 2)
    assert balanced_ep_bytes(cfg, 4, 4) == 2 * 1 * (4 * 2 * 256 * 3 / 4 * 64 * 4 + 8 * 8 * 3 / 4)
    assert balanced_ep_bytes(cfg, 2, 1) == 0.0


def test_an_expert_parallel_record_takes_medians_after_the_warm_up():
    cfg = lab_config(True)
    record = ep_record(moe_events(12), cfg, 2, 2)
    assert record["steps"] == 9 and record["bytes_per_step"] == 1_000_000 + 7  # steps 3 … 11
    assert record["counted_vs_formula"] == pytest.approx(record["bytes_per_step"] / balanced_ep_bytes(cfg, 2, 2))
    assert record["typical_step"] == 7 and record["timeline"]["model_comm"]
    assert record["all_to_all_frac"] == 0.1 and record["moe_layers"] == 2 and record["micro_batches"] == 2


# ---------------------------------------------------------------- the run pictures, from events


def test_load_shares_are_each_expert_over_the_steps_mean():
    steps = panels.routed_steps(moe_events(3, skew=14))
    shares = panels.load_shares(steps, 0)
    assert len(shares) == 8 and len(shares[0]) == 3
    assert shares[0] == pytest.approx([46 / 32, 39 / 32, 1.0])  # the overload fades step by step
    assert all(sum(column) == pytest.approx(8.0) for column in zip(*shares))  # shares average 1
    assert panels.worst_max_mean(steps[0]) == pytest.approx(46 / 32)
    assert panels.share_scale([steps]) == 2.0 and panels.share_scale([panels.routed_steps(moe_events(3, 70))]) > 2


def test_the_lines_say_what_the_runs_say():
    runs = {arm: {"events": moe_events(12, skew=skew, val_loss=loss, aux=aux, drop=drop), "summary": None}
            for arm, skew, loss, aux, drop in (("none", 70, 2.6, None, 0.2), ("aux_loss", 14, 2.5, 0.011, 0.0),
                                               ("loss_free", 0, 2.4, None, 0.0))}
    rows = balance_rows(runs)
    assert [r["balance"] for r in rows] == ["none", "aux_loss", "loss_free"]
    assert rows[0]["drop_rate"] == pytest.approx(0.2) and rows[2]["max_mean"] == pytest.approx(1.0)
    assert rows[1]["aux_loss"] == pytest.approx(0.022) and rows[0]["aux_loss"] is None  # both layers' terms
    table = lab13.balance_lines(rows)
    assert "20.0%" in table[1] and "n/a" in table[1] and "2.400" in table[3] and not too_wide("\n".join(table))
    summary = {"params": {"total": 500_000, "active": 150_000}, "val_loss": 2.5}
    live = lab13.live_lines(summary, runs["aux_loss"]["events"])
    assert "500,000 held, 150,000 used by each token (30%" in live[0] and "2.500" in live[2]
    assert lab13.live_lines(None, []) == []


def test_the_all_to_all_and_drop_sentences_fit_and_say_formula_beside_counted():
    record = {**ep_record(moe_events(12), lab_config(True), 2, 2), "config": "a config"}
    lines = lab13.ep_lines(record)
    said = [" ".join(line.split()) for line in lines]  # wrapped at the output's width
    assert "1,000,007 B" in said[1] and "1,048,704 B (formula" in said[1] and "exposed" in said[2]
    curves = {"router as drawn": drop_curve(0.0), "expert 0's logit +2": drop_curve(2.0)}
    table = lab13.drop_lines(curves)
    assert table[-1].startswith("formula (even)") and "75.0%" in table[-1]
    routed = route(skew=2.0, bias_steps=30)
    text = lab13.explorer_text(routed)
    assert "⌈2·512/8 × 1.25⌉ = 160" in text and "after 30 moves" in text
    assert "dropless" in lab13.explorer_text(route(factor=None))
    assert not too_wide("\n".join(lines + table + [text]))


def test_the_explorer_redraws_on_every_control():
    explorer = lab13.RoutingExplorer()
    before = explorer.text.value
    explorer.skew.value = 3.0
    assert explorer.text.value != before and explorer.picture.value
    explorer.dropless.value = True
    assert explorer.factor.disabled and "dropless" in explorer.text.value
    explorer.experts.value, explorer.top_k.value = 4, 4
    assert "max/mean load 1.00" in explorer.text.value  # top-4 of 4: every expert takes every token
    explorer.bias_steps.value = 50
    assert "after 50 moves" in explorer.text.value


# ---------------------------------------------------------------- the results file: the scaling trade, balancing


def dense_record(quick: bool, val_losses=(2.5, 2.4)) -> dict:
    flops = {"check": "active FLOPs per token, MoE/dense", "dense_flops_per_token": 1e6, "moe_flops_per_token": 1.004e6,
             "ratio": 1.004, "held": True, "tolerance": 0.01, "dense_params": {"total": 100_000},
             "moe_params": {"total": 400_000}}
    speed = {"check": "MoE/dense tokens per second", "summary": "MoE/dense tokens/s 0.8 (IQR 0.7–0.9, 6 rounds)"}
    losses = [{"check": f"{m} loss", "model": m, "val_loss": v, "train_loss_last10": v + 0.1, "final_loss": v,
               "val_floor": 2.0} for m, v in zip(("dense", "moe"), val_losses)]
    return {"benchmark": "moe", "table": "dense", "commit": "a" * 40, "date": "2027-01-01T00:00:00+00:00",
            "machine": {"cpu": "a CPU", "cores": 2, "isa": [], "torch": "2.13.0"},
            "settings": {"quick": quick, "steps": 200}, "rows": [flops, speed, *losses]}


def test_the_scaling_trade_is_the_newest_full_table_and_says_so_when_there_is_none(tmp_path, monkeypatch):
    assert dense_trade([dense_record(quick=True)]) is None  # a smoke run is no measurement
    trade = dense_trade([dense_record(False, (2.6, 2.5)), dense_record(False), dense_record(True)])
    assert trade["dense"]["val_loss"] == 2.5 and trade["moe"]["val_loss"] == 2.4 and trade["flops"]["held"]
    lines = lab13.trade_lines(trade)
    assert "dense 100,000, MoE 400,000" in lines[0] and "2.4000" in lines[2] and "moe.jsonl" in lines[-1]
    assert "not measured" in lab13.trade_lines(None)[0] and not too_wide("\n".join(lines))
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    assert dense_trade() is None and balance_benchmark() is None  # no file: not measured
    (tmp_path / "moe.jsonl").write_text(json.dumps(dense_record(False)) + "\n")
    assert dense_trade()["moe"]["val_loss"] == 2.4 and balance_benchmark() is None


def test_the_balance_benchmark_lines_keep_a_lower_bound_a_lower_bound():
    row = {"method": "aux_loss alpha=0.01", "at_least": True, "median": 1500, "q1": 900, "q3": 1500, "reached": 4,
           "n_seeds": 6, "bound": 1500, "lm_loss_last10": 2.1}
    record = {**dense_record(False), "table": "balance", "settings": {"quick": False, "balanced": 1.1}, "rows": [row]}
    lines = lab13.benchmark_balance_lines(record)
    assert "at least 1500 steps" in lines[1] and "4 of 6 seeds" in lines[1]
    assert "not measured" in lab13.benchmark_balance_lines(None)[0]


def test_the_ep_benchmark_lines_say_each_degree_against_one():
    row = {"check": "ep=2 step time / ep=1", "summary": "ep2/ep1 1.577 (IQR 1.525–1.620, 6 rounds): slower",
           "measured_all_to_all_frac": 0.36, "bytes_per_step_counted": 530496.0, "counted_vs_formula": 1.0117,
           "measured_max_mean": 1.46, "modelled_vs_measured_step": 0.72, "modelled_vs_measured_all_to_all": 0.42}
    record = {**dense_record(False), "table": "ep", "rows": [row]}
    assert ep_benchmark([record]) is record and ep_benchmark([{**record, "settings": {"quick": True}}]) is None
    lines = [" ".join(line.split()) for line in lab13.benchmark_ep_lines(record)]
    assert "ep2/ep1 1.577" in lines[1] and "36% of the step" in lines[1] and "530,496 B a step, 1.012×" in lines[1]
    assert "moe.jsonl" in lines[-1] and "not measured" in lab13.benchmark_ep_lines(None)[0]
    assert "step 0.72×, all-to-all 0.42× the measured" in " ".join(lines)


def test_the_shipped_results_render_with_the_keys_the_benchmark_writes_now():
    """The notebook renders the newest tables of benchmarks/results/moe.jsonl: a benchmark that renames a key breaks
    this test, not the lab in front of a room."""
    from labkit.results import load_results

    from labkit.widgets.moe import trade_figure, trade_lines

    records = load_results("moe")
    assert len(lab13.benchmark_ep_lines(ep_benchmark(records))) > 2
    assert len(lab13.benchmark_balance_lines(balance_benchmark(records))) > 2
    trade = dense_trade(records)
    assert trade is not None and trade_lines(trade) and trade_figure(trade) is not None


# ---------------------------------------------------------------- the dashboard follows a MoE run with its picture


class FakePainter:
    def __init__(self):
        self.asked = []

    def submit(self, figure, events_path, title=""):
        from concurrent.futures import Future

        self.asked.append(figure)
        done = Future()
        done.set_result((b"\x89PNG painted", 0.01, 0.0, 0.01))
        return done


class FakeRun:
    def __init__(self, tmp_path, events):
        self.run_dir, self._events, self.label = tmp_path, events, ""

    def events(self):
        return self._events


def test_a_dashboard_draws_the_routing_picture_live_and_at_the_end(tmp_path, monkeypatch):
    import labkit.widgets.dashboard as dash

    fake = FakePainter()
    monkeypatch.setattr(dash, "painter", lambda: fake)
    run = FakeRun(tmp_path, moe_events(6))
    dashboard = dash.RunDashboard(figure=lab13.ROUTING_FIGURE)
    dashboard.update(run)
    assert fake.asked == ["labkit.widgets.moe_panels:routing_figure"]
    run._events = run._events + [{"type": "end", "status": "finished"}]
    dashboard.update(run, final=True)
    assert dashboard.png.startswith(b"\x89PNG") and dashboard.png != b"\x89PNG painted"
    assert dash.RunDashboard().figure == dash.FIGURE  # every other lab's dashboard as before


def test_the_routing_picture_waits_for_a_routed_step():
    fig = panels.routing_figure([{"type": "start", "steps": 5}])
    assert "no routed step yet" in fig.axes[0].texts[0].get_text()
    assert len(panels.routing_figure(moe_events(4)).axes) == 2 + 1 + 3  # 2 heatmaps, their colour bar, 3 panels


# ---------------------------------------------------------------- the lab's real runs


@pytest.mark.multiproc
def test_the_lab_runs_are_real_runs_that_count_their_routing_and_their_all_to_all(tmp_path):
    cfg = lab_config(True, **{"run.steps": 6, "run.eval_every": 6, "run.runs_dir": str(tmp_path)})
    heard = []
    runs = balance_runs(cfg, 2, arms=("none", "loss_free"), on_progress=heard.append)
    assert heard == ["run 1/2: none…", "run 2/2: loss_free…", "done: 2 runs"]
    for arm, run in runs.items():
        steps = panels.routed_steps(run["events"])
        assert len(steps) == 6 and all(len(e["moe_load"]) == 2 for e in steps), arm
        assert all(sum(load) == 2 * 16 * 64 for e in steps for load in e["moe_load"]), arm  # k · every token a step
        assert panels.final_val_loss(run["events"]) is not None and run["summary"]["status"] == "finished", arm
    ep = ep_run(cfg, 2, 2)
    assert ep["steps"] == 3 and ep["bytes_per_step"] > 0 and 0 < ep["all_to_all_frac"] < 1
    assert 0.5 < ep["counted_vs_formula"] < 1.5  # near the balanced formula: routing is never quite even
    assert ep["timeline"].get("model_comm")  # the all-to-alls, on the step's timeline
    assert processes_mentioning(str(tmp_path)) == []
