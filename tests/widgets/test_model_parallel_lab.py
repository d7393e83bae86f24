"""The model-parallel lab: a layout on widgets (dp × tp × pp = the processes this machine hosts), refused before
anything starts when it cannot run, and the pictures it draws from a run's events."""
import pytest

import labkit.config
import labkit.validation
import labkit.widgets.model_parallel as mp
from helpers import legible, tiny_config
from labkit.parallel.pp.pipeline import ideal_schedule
from labkit.plots import render_png


@pytest.fixture
def two_cores(monkeypatch):
    """A 2-core CPU machine, whatever this one is: up to 4 processes, 8 for a small model."""
    for module in (labkit.config, labkit.validation, mp):
        monkeypatch.setattr(module, "cpu_count", lambda: 2)
    monkeypatch.setattr(mp, "resolve_device", lambda cfg: "cpu")


def config(**dotted):
    return tiny_config(**{"model.n_layer": 2, "parallel.dp.strategy": "ddp_naive", "run.steps": 3, **dotted})


def test_the_process_counts_are_the_machines_and_8_is_offered_with_its_cost(two_cores):
    options = mp.process_options(config())
    assert [n for _, n in options] == [1, 2, 4, 8]
    assert options[-1][0] == "8 (oversubscribed: 4 per core, slow)"
    big = config(**{"model.n_embd": 512, "model.n_layer": 12, "model.n_head": 8})  # over 2 M parameters
    assert [n for _, n in mp.process_options(big)] == [1, 2, 4]
    n, note = mp.choose_nproc(big, 8)
    assert n == 4 and "8 asked for" in note and "2 CPU core(s): up to 4 processes" in note
    n, note = mp.choose_nproc(config(), 8)
    assert n == 8 and "processes per core share each core in turn" in note


def test_the_degrees_always_multiply_to_the_processes(two_cores):
    lab = mp.ModelParallelLab(config(), nproc=4)
    assert list(lab.tp.options) == [1, 2, 4] and list(lab.pp.options) == [1, 2, 4] and lab.dp.value == 4
    lab.tp.value = 2
    assert list(lab.pp.options) == [1, 2] and lab.dp.value == 2
    lab.pp.value = 2
    assert lab.dp.value == 1
    lab.nproc.value = 2  # tp = 2 still divides; pp = 2 no longer fits beside it
    assert (lab.tp.value, lab.pp.value, lab.dp.value) == (2, 1, 1)
    lab.micro_batches.value = 8
    over = lab.overrides()
    assert over["data.batch_size"] == 8 * 1 * 4 and over["parallel.dp.degree"] == 1
    assert lab.label() == "tp=2" and not lab.run_button.disabled and "✓ tp=2" in lab.status.value


def test_a_layout_that_cannot_run_is_explained_and_starts_nothing(two_cores, monkeypatch):
    launched = []
    monkeypatch.setattr("labkit.launcher.launch", lambda *a, **k: launched.append(a))
    lab = mp.ModelParallelLab(config(), nproc=2)
    lab.pp.value = 2
    lab.strategy.value = "torch_ddp"
    assert lab.run_button.disabled and "Cannot run this layout" in lab.status.value
    assert "parallel.dp.strategy=torch_ddp does not combine with parallel.pp.impl=labkit" in lab.status.value
    assert lab.run() is None and not launched
    lab.strategy.value = "ddp_naive"
    lab.pp.value, lab.tp.value = 1, 2
    lab.sequence_parallel.value = True
    assert not lab.run_button.disabled  # tp = 2 splits block_size 32 and 2 heads
    lab.nproc.value = 4
    lab.tp.value = 4  # 2 heads cannot be split 4 ways
    assert "model.n_head=2 is not divisible by it" in lab.status.value and lab.run() is None and not launched


def test_the_strategy_dropdown_offers_auto_and_the_panel_says_what_it_chose(two_cores):
    lab = mp.ModelParallelLab(config(), nproc=2)
    assert list(lab.strategy.options)[0] == "auto" and lab.strategy.value == "ddp_naive"  # the config's, kept
    lab.strategy.value = "auto"
    lab.pp.value = 2
    assert not lab.run_button.disabled and "dp strategy auto → ddp_naive: the first strategy" in lab.status.value
    assert lab.config().parallel.dp.strategy == "auto"  # the run resolves it as the panel said


def test_eight_processes_say_what_they_cost(two_cores):
    lab = mp.ModelParallelLab(config(), nproc=8)
    lab.tp.value = 2
    lab.pp.value = 2
    assert lab.dp.value == 2 and not lab.run_button.disabled
    assert "⚠ nproc=8 on 2 CPU core(s)" in lab.status.value


# ---------------------------------------------------------------- the pictures, from synthetic rows

def span(kind, mb, start, end, wait=0.0):
    return {"kind": kind, "mb": mb, "start": start, "end": end, "wait": wait}


GRID = [[span("F", 0, 0.0, 0.01), span("B", 0, 0.02, 0.04, 0.005)],
        [span("F", 0, 0.0, 0.02, 0.01), span("B", 0, 0.02, 0.03)]]


def test_the_schedule_is_drawn_measured_beside_ideal():
    fig = mp.schedule_figure(GRID, ideal_schedule(2, 1, "gpipe"), "pp=2")
    measured, ideal = fig.axes
    assert [t.get_text() for t in measured.get_yticklabels()] == ["stage 0", "stage 1"]
    assert len(measured.collections) == 6  # 4 spans and 2 waits
    assert len(ideal.collections) == 4 and "F0" in [t.get_text() for t in ideal.texts]
    assert measured.get_xlim() == (0.0, pytest.approx(40.0))  # ms
    assert legible(fig) and render_png(fig).startswith(b"\x89PNG")
    assert "no measured spans" in mp.schedule_figure(None, ideal_schedule(2, 1, "1f1b")).axes[0].texts[0].get_text()
    titles = [ax.get_title() for ax in mp.ideal_schedules_figure(2, 4).axes]
    assert titles == ["gpipe: p = 2, m = 4; micro-batches held per stage [4, 4]",
                      "1f1b: p = 2, m = 4; micro-batches held per stage [2, 1]"]


def test_the_bubble_is_drawn_against_the_formula():
    rows = [{"p": 2, "m": m, "schedule": "gpipe", "bubble": b, "idle": b - 0.02, "ideal": 1 / (m + 1), "step_s": 1.0}
            for m, b in ((1, 0.55), (2, 0.4), (4, 0.25))]
    fig = mp.bubble_figure(rows)
    curve, measured, idle = fig.axes[0].lines
    assert curve.get_ydata()[0] == pytest.approx(50.0) and curve.get_ydata()[-1] == pytest.approx(20.0)
    assert list(measured.get_ydata()) == pytest.approx([55.0, 40.0, 25.0]) and list(idle.get_xdata()) == [1, 2, 4]
    assert legible(fig)
    assert "p=2 m= 4 gpipe : bubble measured  25.0%" in mp.bubble_text(rows)


def tp_row(measured, sp=False):
    parts = {"embedding": 10, "per_layer": 100, "blocks": 200, "head": 10, "loss": 3, "total": 223,
             "sequence_parallel_sync": 7 if sp else 0}
    return {"tp": 2, "pp": 1, "sequence_parallel": sp, "micro_batches": 2, "n_layer": 2, "measured_total": measured,
            "analytic_total": 446 + parts["sequence_parallel_sync"],
            "measured_per_layer": None if measured is None else 100,
            "analytic_per_layer": 100, "analytic_parts": parts}


def test_tensor_parallel_bytes_are_drawn_beside_the_count():
    rows = [("tp=2", tp_row(446)), ("tp=2 SP", tp_row(453, sp=True)), ("dtensor", tp_row(None))]
    fig = mp.tp_bytes_figure(rows)
    per_layer, total = fig.axes
    assert [p.get_height() for p in per_layer.patches] == pytest.approx([200e-6, 200e-6, 0.0])
    assert "not\ncounted" in [t.get_text() for t in per_layer.texts]
    assert [t.get_text() for t in total.get_xticklabels()] == ["tp=2", "tp=2 SP", "dtensor"]
    legend = [t.get_text() for t in total.get_legend().get_texts()]
    assert legend == ["measured", "analytic: embedding", "analytic: blocks", "analytic: head", "analytic: loss",
                      "analytic: SP grad sync"]
    assert legible(fig)
    assert "not counted" in mp.tp_bytes_text(rows) and "0.000446 MB per step measured" not in mp.tp_bytes_text(rows)


def memory_row(rank, pp, measured, predicted):
    return {"rank": rank, "dp": 0, "pp": pp, "tp": 0, "params": predicted // 16,
            "measured": {"param": measured / 4, "grad": measured / 4, "optimizer": measured / 2},
            "measured_total": measured, "predicted": {}, "predicted_total": predicted}


def test_memory_per_rank_is_drawn_beside_the_prediction():
    runs = [("pp=2", [memory_row(0, 0, 1.6e6, 1.6e6), memory_row(1, 1, 1.4e6, 1.4e6)]),
            ("tp=2", [memory_row(0, 0, 1.5e6, 1.5e6), memory_row(1, 0, 1.5e6, 1.5e6)])]
    fig = mp.memory_figure(runs)
    ax = fig.axes[0]
    assert len(ax.patches) == 12 and [t.get_text() for t in ax.get_xticklabels()] == ["r0", "r1", "r0", "r1"]
    assert {t.get_text() for t in ax.texts} == {"pp=2", "tp=2"}
    assert legible(fig)
    assert mp.memory_text(runs).splitlines()[2].split() == ["pp=2", "1", "0", "1", "0", "87,500", "1.400", "1.400"]


def activation_row(rank, measured, predicted, held):
    return {"rank": rank, "dp": 0, "pp": rank, "tp": 0, "layers": 1, "measured": measured, "predicted": predicted,
            "held": held, "held_predicted": 2 - rank, "measured_peak": None if measured is None else measured * held,
            "predicted_peak": predicted * (2 - rank)}


def test_activations_per_rank_are_drawn_beside_the_prediction():
    report = {"rows": [activation_row(0, 2e6, 2e6, 2), activation_row(1, 3e6, 3e6, 1)], "why_not": None}
    uncounted = {"rows": [activation_row(0, None, 2e6, None), activation_row(1, None, 3e6, None)], "why_not": None}
    fig = mp.activation_figure([("pp=2 1f1b", report), ("torch", uncounted)])
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == pytest.approx([4.0, 3.0, 4.0, 3.0])  # MB: × the micro-batches held
    assert [t.get_text() for t in ax.get_xticklabels()] == ["r0\n×2", "r1\n×1", "r0\n×?", "r1\n×?"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [  # each entry once
        "measured", "not counted by the run", "predicted (activation_memory)"]
    assert legible(fig)
    text = mp.activation_text([("pp=2 1f1b", report), ("torch", uncounted)])
    assert "pp=2 1f1b: activations per rank" in text and "n/a (1)" in text


def test_the_step_split_is_drawn_as_stacked_parts():
    split = {"compute": 0.05, "data": 0.001, "dp_comm": 0.002, "model_comm": 0.01, "bubble": 0.02, "step": 0.083}
    fig = mp.step_split_figure([("pp=2", split), ("fsdp2", {**{k: None for k in split}, "step": 0.1})])
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert widths[:5] == pytest.approx([50, 1, 2, 10, 20]) and widths[5] == pytest.approx(100)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fsdp2", "pp=2"]
    assert legible(fig)
    assert mp.split_text([("pp=2", split)]).splitlines()[1].split() == ["pp=2", "83.0", "50.0", "1.0", "2.0", "10.0",
                                                                         "20.0"]
    assert mp.split_text([("torch", {**split, "bubble_counted": False})]).endswith(
        "* torch: torch's pipeline waits not timed, inside compute")


# ---------------------------------------------------------------- a real run through the button

@pytest.mark.multiproc
def test_the_run_button_runs_a_pipeline_live_and_draws_what_it_measured():
    lab = mp.ModelParallelLab(config(), nproc=2)
    lab.pp.value = 2
    lab.schedule.value = "gpipe"
    lab.micro_batches.value = 4
    lab.run_button.click()
    record = lab.record
    assert record is not None and record["label"] == "pp=2 gpipe m=4"
    assert any(e["type"] == "step" for e in lab.dashboard.events)  # the dashboard followed it
    assert len(lab.figures.children) == 4  # step split, model states and activations per rank, the schedule
    assert all(bytes(img.value).startswith(b"\x89PNG") for img in lab.figures.children)
    assert "bubble measured" in lab.status.value and "stage 0 held 4 micro-batches" in lab.status.value
    assert "(predicted 4)" in lab.status.value
    for row in mp.memory_rows([record])[0][1]:
        assert row["measured_total"] == row["predicted_total"]
    assert "predicted peak MB" in lab.status.value
    for row in mp.activation_rows([record])[0][1]["rows"]:  # GPipe: each stage holds all 4 micro-batches
        assert row["held"] == row["held_predicted"] == 4 and row["measured"] >= row["predicted"]
    assert not lab.run_button.disabled
