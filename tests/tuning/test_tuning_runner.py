"""The optimisation loop: end to end on real 2-process CPU runs, and step by step on scripted measurements."""
import time
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba

import labkit
from labkit.tuning.runner import (
    MEASURE,
    RECORD_BEST,
    TrialFailed,
    config_allows,
    default_available,
    optimize,
)
from labkit.metrics.store import RunStore
from labkit.tuning.flowchart import (
    COMMUNICATION_BOUND,
    KERNELS_AND_COMPILE,
    Measurement,
    Thresholds,
)
from labkit.widgets.tuning import (
    CURRENT_COLOR,
    IDLE_COLOR,
    UTILIZATION_CHECK,
    VISITED_COLOR,
    AdvisorLab,
    flowchart_figure,
    trials_figure,
    trials_table_html,
    visited_nodes,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = {"model.n_layer": 1, "model.n_embd": 32, "run.steps": 6, "run.eval_every": 0, "run.save_final": False,
        "metrics.progress": False, "comm.bandwidth_gbps": 0.05, "comm.latency_us": 50.0}


def tiny_config(runs_dir) -> labkit.Config:
    return labkit.load_config(ROOT / "configs/quickstart.yaml").replace(**TINY, **{"run.runs_dir": str(runs_dir)})


def measured(decisions):
    return [d for d in decisions if d.trial is not None]


# ---------------------------------------------------------------- scripted measurements: each rule, exactly

class Script:
    """A stand-in for real runs: throughput (and loss) as a function of the config, calls counted."""

    def __init__(self, rate, loss=lambda d: 2.0, sleep_s=0.0, comm=0.5):
        self.rate, self.loss, self.sleep_s, self.comm, self.calls = rate, loss, sleep_s, comm, []

    def __call__(self, config, nproc, repeats):
        d = config.to_dict()
        self.calls.append(d)
        time.sleep(self.sleep_s)
        tok = self.rate(d)
        if tok is None:
            raise TrialFailed("run failed: worker exit code 1")
        return Measurement.from_repeats([tok * 0.999, tok * 1.001][:repeats], mfu=0.2, comm_frac=self.comm,
                                        loss=self.loss(d)), []


def by_compression(table, default=1000.0):
    return lambda d: table.get(d["comm"]["compression"], default) if d["comm"]["sync"] == "every_step" else 500.0


def test_a_slower_change_is_never_kept_and_a_kept_one_becomes_the_baseline():
    script = Script(by_compression({"none": 1000.0, "bf16": 1200.0, "powersgd": 1150.0, "topk": 1500.0}),
                    loss=lambda d: 3.0 if d["comm"]["compression"] == "topk" else 2.0)
    seen = []
    result = optimize(labkit.Config(), 2, max_trials=20, measure=script, on_decision=seen.append)
    assert seen == result.decisions and result.decisions[0].node == MEASURE
    assert result.decisions[-1].node == RECORD_BEST
    by_feature = {d.candidate.feature: d for d in measured(result.decisions)}
    assert by_feature["comm.compression=bf16"].kept
    powersgd = by_feature["comm.compression=powersgd"]
    assert not powersgd.kept and powersgd.baseline.tokens_per_s == pytest.approx(1200.0)  # compared with bf16
    assert not by_feature["comm.compression=topk"].kept and "loss" in by_feature["comm.compression=topk"].reason
    assert not by_feature["comm.sync=local_sgd"].kept
    assert result.best_overrides == {"comm.compression": "bf16"}
    assert result.speedup == pytest.approx(1.2)
    for d in measured(result.decisions):
        assert not (d.kept and d.trial.tokens_per_s <= d.baseline.tokens_per_s)


def test_unavailable_and_invalid_candidates_are_logged_with_their_reason_and_never_run():
    script = Script(lambda d: 1000.0)
    result = optimize(labkit.Config(), 2, max_trials=20, measure=script,
                      available={"comm.compression=powersgd": "no PowerSGD on this cluster"},
                      steps=6)  # run.compile=verify needs more steps than 6
    reasons = {d.candidate.feature: d.reason for d in result.decisions if d.candidate and d.trial is None}
    assert "no PowerSGD on this cluster" in reasons["comm.compression=powersgd"]
    assert "invalid config" in reasons["run.compile=verify"] and "run.steps" in reasons["run.compile=verify"]
    assert not any(c["comm"]["compression"] == "powersgd" for c in script.calls)
    assert not any(c["run"]["compile"] == "verify" for c in script.calls)
    assert all(c["run"]["steps"] == 6 for c in script.calls)


def test_a_failed_trial_is_rejected_and_the_walk_goes_on():
    script = Script(lambda d: None if d["comm"]["compression"] == "bf16" else 1000.0)
    result = optimize(labkit.Config(), 2, max_trials=3, measure=script)
    first = next(d for d in result.decisions if d.candidate)
    assert first.candidate.feature == "comm.compression=bf16" and not first.kept
    assert first.reason.startswith("rejected: the trial run failed")
    assert result.trials == 3 and len(script.calls) == 1 + 3


def test_the_budgets_stop_the_walk():
    by_trials = optimize(labkit.Config(), 2, max_trials=1, measure=Script(lambda d: 1000.0))
    assert by_trials.trials == 1 and "trial budget" in by_trials.stopped_because
    slow = Script(lambda d: 1000.0, sleep_s=0.3)
    by_time = optimize(labkit.Config(), 2, max_trials=50, time_budget_s=1.0, measure=slow)
    assert "time budget" in by_time.stopped_because and by_time.wall_s <= 1.0
    assert 1 <= by_time.trials <= 2


def test_measure_config_decides_on_exposed_communication(monkeypatch):
    """The runs' summaries carry both shares; the measurement keeps both and the loop classifies on exposed."""
    from types import SimpleNamespace

    from labkit.tuning import runner
    from labkit.tuning.flowchart import COMPUTE_BOUND, classify

    def fake_run(summary):
        return lambda config, nproc, label: SimpleNamespace(summary=summary, run_dir=Path("runs/fake"))

    hidden = {"tokens_per_s": 1000.0, "mfu": 0.2, "comm_frac": 0.8, "comm_exposed_frac": 0.05, "final_loss": 2.0}
    monkeypatch.setattr(runner, "run_to_end", fake_run(hidden))
    m, _ = runner.measure_config(labkit.Config(), 2, 2)
    assert (m.comm_frac, m.comm_exposed_frac) == (0.8, 0.05)
    assert classify(m)[0] == COMPUTE_BOUND  # in flight 80%, but the step waited only 5% for it
    monkeypatch.setattr(runner, "run_to_end", fake_run({**hidden, "comm_frac": 0.5, "comm_exposed_frac": 0.45}))
    assert classify(runner.measure_config(labkit.Config(), 2, 1)[0])[0] == COMMUNICATION_BOUND


@pytest.mark.parametrize("kwargs, message", [
    ({"max_trials": 0}, "max_trials"), ({"time_budget_s": 0}, "time_budget_s"), ({"repeats": 0}, "repeats"),
    ({"thresholds": Thresholds(utilization=70)}, "did you mean 0.7"),
    ({"thresholds": Thresholds(comm_frac=-0.1)}, "comm_frac"),
])
def test_bad_input_fails_before_any_run(kwargs, message):
    script = Script(lambda d: 1000.0)
    with pytest.raises(ValueError, match=message):
        optimize(labkit.Config(), 2, measure=script, **kwargs)
    assert script.calls == []


def test_default_availability_matches_labkits_config():
    available = default_available()
    assert available["comm.compression=powersgd"] is True and available["run.compile=verify"] is True
    assert available["attention.backend=labkit_flash"] is True and available["comm.sync=diloco"] is True
    assert "choices" in config_allows("attention.backend", "xformers")
    assert "no key" in config_allows("comm.teleport", True)


# ---------------------------------------------------------------- the widgets' pictures

def test_flowchart_and_sliders_name_the_exposed_share():
    texts = [t.get_text() for t in flowchart_figure(None).axes[0].texts]
    assert any("exposed comm > 35%" in t for t in texts)
    lab = AdvisorLab(labkit.Config(), 2)
    assert "exposed" in lab.comm_frac.description and lab.comm_frac.value == 35


def test_flowchart_highlights_the_current_node_and_shades_the_visited():
    fig = flowchart_figure(COMMUNICATION_BOUND, [MEASURE, UTILIZATION_CHECK])
    colors = {node: patch.get_facecolor() for node, patch in fig.node_patches.items()}
    assert colors[COMMUNICATION_BOUND] == to_rgba(CURRENT_COLOR)
    assert colors[MEASURE] == colors[UTILIZATION_CHECK] == to_rgba(VISITED_COLOR)
    assert colors[KERNELS_AND_COMPILE] == colors[RECORD_BEST] == to_rgba(IDLE_COLOR)
    with pytest.raises(ValueError, match="unknown flowchart node"):
        flowchart_figure("nowhere", [])


def test_table_and_figure_show_every_try_with_its_verdict():
    script = Script(by_compression({"none": 1000.0, "bf16": 1200.0}, default=900.0))
    result = optimize(labkit.Config(), 2, max_trials=2, measure=script, available={"comm.compression=topk": False})
    table = trials_table_html(result.decisions)
    assert table.count("<tr>") == len(result.decisions) + 1
    assert ">kept<" in table and ">rejected<" in table
    assert visited_nodes(result.decisions)[:3] == [MEASURE, UTILIZATION_CHECK, COMMUNICATION_BOUND]
    bars = trials_figure(result.decisions).axes[0].patches
    assert len(bars) == 1 + result.trials


def test_the_advisor_reads_at_a_notebooks_width_and_shows_no_broken_image():
    import re

    from labkit.plots import illegible_texts

    lab = AdvisorLab(labkit.Config(), 2)
    assert lab.flowchart.showing_placeholder and "press Start" in lab.flowchart.waiting  # no empty image
    script = Script(by_compression({"none": 1000.0, "bf16": 1200.0}, default=900.0))
    result = optimize(labkit.Config(), 2, max_trials=4, measure=script, available={"comm.compression=topk": False})
    assert illegible_texts(trials_figure(result.decisions)) == [] == illegible_texts(flowchart_figure(None))
    table = trials_table_html(result.decisions)
    cells = re.findall(r"<t[dh] style='([^']*)'", table)
    prose = [c for c in cells if "white-space:nowrap" not in c]  # only the reasons may wrap (between words)
    assert len(prose) == len(result.decisions) and all("min-width" in c for c in prose)
    assert "overflow-x:auto" in table  # a narrow screen scrolls the table in its own box


# ---------------------------------------------------------------- for real: 2 processes, tiny runs

@pytest.fixture(scope="module")
def real_walk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("advisor")
    seen = []
    with RunStore(tmp / "store.db") as store:
        result = optimize(tiny_config(tmp / "runs"), 2, max_trials=2, time_budget_s=150, repeats=2,
                          on_decision=seen.append, store=store, out_yaml=tmp / "best.yaml")
        recorded = [r["id"] for r in store.list_runs()]
    return result, seen, recorded, tmp


@pytest.mark.multiproc
def test_real_walk_stays_in_budget_and_logs_every_try(real_walk):
    result, seen, _, _ = real_walk
    assert result.wall_s <= 150 and result.trials <= 2
    assert seen == result.decisions
    tries = [d for d in result.decisions if d.candidate and (d.trial or d.reason.startswith("rejected"))]
    assert len(tries) == result.trials
    assert all(len(d.trial.repeats) == 2 for d in measured(result.decisions))
    assert len(result.baseline.repeats) == 2 and result.baseline.tokens_per_s > 0


@pytest.mark.multiproc
def test_real_walk_never_keeps_a_slower_change(real_walk):
    result, _, _, _ = real_walk
    for d in measured(result.decisions):
        if d.trial.tokens_per_s < d.baseline.tokens_per_s:
            assert not d.kept
    assert result.best.tokens_per_s >= result.baseline.tokens_per_s
    kept = {}
    for d in result.kept:
        kept.update(d.candidate.overrides)
    assert kept == result.best_overrides


@pytest.mark.multiproc
def test_real_walk_writes_a_loadable_yaml_and_records_the_best_run(real_walk):
    result, _, recorded, tmp = real_walk
    loaded = labkit.load_config(tmp / "best.yaml")
    expected = tiny_config(tmp / "runs").replace(**result.best_overrides)
    assert loaded.to_dict() == expected.to_dict()
    assert result.recorded_run_id in recorded and result.recorded_run_id == result.best_run_dirs[-1].name


@pytest.mark.multiproc
def test_start_button_runs_the_loop_with_the_sliders_settings(tmp_path):
    lab = AdvisorLab(tiny_config(tmp_path / "runs"), 2, repeats=1)
    lab.utilization.value, lab.comm_frac.value, lab.max_trials.value, lab.time_budget.value = 50, 20, 1, 120
    lab.start_button.click()
    assert lab.result is not None, lab.status.value
    assert "done in" in lab.status.value and lab.result.trials <= 1
    assert "20%" in lab.decisions[0].reason and "50%" in lab.decisions[0].reason  # the sliders reached optimize
    assert lab.table.value.count("<tr>") == len(lab.decisions) + 1
    assert lab.flowchart.value[:4] == b"\x89PNG" and not lab.start_button.disabled


def test_start_button_shows_errors_in_the_status_line(tmp_path):
    lab = AdvisorLab(tiny_config(tmp_path / "runs"), nproc=99)
    lab.start_button.click()  # must not raise: the error is shown
    assert lab.result is None and "Failed" in lab.status.value and "nproc=99" in lab.status.value
    assert not list((tmp_path / "runs").glob("*"))
