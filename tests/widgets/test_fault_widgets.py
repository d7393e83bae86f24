"""The fault-tolerance lab: pictures and lines of text (pure functions of a run's files), its buttons (real runs)."""
import json
import threading
import time
from pathlib import Path

import ipywidgets as W
import pytest
import torch

from helpers import processes_mentioning, tiny_config
from labkit.config import save_config
from labkit.fault.recovery import (attempts, measured_checkpoint_cost, recovery_report, same_parameters,
                                   seconds_between_checkpoints)
from labkit.launcher import open_run
from labkit.plots import illegible_texts, render_png
from labkit.widgets.fault import (LAB_STEPS, FaultToleranceLab, outcome_text, overhead_figure, progress_text,
                                  recovery_figure)
from labkit.widgets.picture import Picture

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "07_fault_tolerance.ipynb"
CRASH = {"kind": "crash", "rank": 1, "step": 8, "time": 108.5, "recovery_s": 11.5}


def _events():
    steps = [{"type": "step", "step": s, "loss": 3 - 0.1 * s, "time": 100 + s} for s in range(8)]
    resumed = [{"type": "step", "step": s, "loss": 3 - 0.1 * s, "time": 120 + s} for s in range(5, 10)]
    saves = [{"type": "checkpoint", "step": s, "blocking_s": b, "time": 100 + s} for s, b in ((4, 0.02), (6, 0.04))]
    return [{"type": "start", "time": 99.0}, *steps[:5], saves[0], *steps[5:7], saves[1], steps[7],
            {"type": "resume", "next_step": 5, "time": 119.0}, *resumed]


def _ended_run(tmp_path, faults=(), restarts=0):
    """A run directory as a finished 10-step run leaves it (``_events``), opened from disk: no process."""
    run_dir = tmp_path / "fault-lab-run"
    run_dir.mkdir()
    save_config(tiny_config(**{"run.steps": 10}), run_dir / "config.json")
    lines = lambda records: "".join(json.dumps(r) + "\n" for r in records)  # noqa: E731
    (run_dir / "events.jsonl").write_text(lines(_events() + [{"type": "end", "status": "finished", "time": 125}]))
    (run_dir / "faults.jsonl").write_text(lines({"type": "fault", **f} for f in faults))
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished", "steps_completed": 10,
                                                      "restarts": restarts, "wall_time_s": 26.0}))
    return open_run(run_dir)


def _shown_images(widget) -> list[W.Image]:
    """Every Image a person would see in a widget tree (a Picture's hidden Image is not seen)."""
    if isinstance(widget, W.Image):
        return [] if widget.layout.display == "none" else [widget]
    return [i for child in getattr(widget, "children", ()) for i in _shown_images(child)]


def _texts(widget) -> str:
    own = widget.value if isinstance(widget, W.HTML) else ""
    return own + "".join(_texts(child) for child in getattr(widget, "children", ()))


# ---------------------------------------------------------------- figures
def test_attempts_split_at_each_resume():
    split = attempts(_events())
    assert [[e["step"] for e in a] for a in split] == [list(range(8)), list(range(5, 10))]


def test_recovery_figure_marks_fault_recovery_and_checkpoints():
    fig = recovery_figure(_events(), [CRASH])
    ax_loss, ax_time = fig.axes
    assert len(ax_loss.lines) == 2 + 2 + 1  # two attempts, two checkpoints, the fault
    labels = ax_time.get_legend_handles_labels()[1]
    assert "crash (rank 1)" in labels and "recovery 11.5 s" in labels


def test_figures_are_legible_at_the_notebook_output_width():
    long_run = [{"type": "step", "step": s, "loss": 3 / (1 + s), "time": 1000.0 + 0.1 * s} for s in range(300)]
    saves = [{"type": "checkpoint", "step": s, "blocking_s": 0.1, "time": 1000.0 + 0.1 * s} for s in range(29, 300, 30)]
    kill = {"kind": "kill", "rank": 1, "step": 123, "time": 1012.3, "recovery_s": 14.2}
    assert illegible_texts(recovery_figure(long_run + saves, [kill])) == []
    assert illegible_texts(recovery_figure(_events(), [CRASH])) == []
    assert illegible_texts(overhead_figure(checkpoint_s=0.11, mtbf_s=1800, measured_interval_s=2.4)) == []


def test_checkpoint_cost_and_interval_from_events():
    assert measured_checkpoint_cost(_events()) == 0.04
    assert seconds_between_checkpoints(_events()) == pytest.approx(2.0)
    assert measured_checkpoint_cost([]) is None and seconds_between_checkpoints([]) is None


def test_overhead_figure_marks_young_daly_optimum():
    fig = overhead_figure(checkpoint_s=0.5, mtbf_s=3600, measured_interval_s=2.0)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "Young/Daly √(2δM) = 60 s" in labels and "this run: every 2.0 s" in labels


def test_same_parameters_names_the_difference():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert same_parameters(a, {k: v.clone() for k, v in a.items()}) == (
        True, "all 2 tensors (5 numbers) are bit-for-bit identical")
    b = {"w": torch.ones(3).nextafter(torch.tensor(2.0)), "b": torch.zeros(2)}
    same, verdict = same_parameters(a, b)
    assert not same and verdict.startswith("1 of 2 tensors differ")


# ---------------------------------------------------------------- the lab, without processes
def test_before_start_the_lab_says_what_to_do_and_shows_no_empty_image():
    lab = FaultToleranceLab(tiny_config())
    shown = lab.widget()
    assert [i for i in _shown_images(shown) if not i.value] == []  # no broken-image icon anywhere
    assert isinstance(lab.figure, Picture) and lab.figure.showing_placeholder
    assert "waiting for the first step" not in _texts(shown)
    assert lab.status_text.startswith("Press Start run") and "Press Start run" in _texts(shown)


def test_the_lab_runs_its_own_length_whatever_the_scripted_config():
    lab = FaultToleranceLab(tiny_config(**{"run.steps": 6, "comm.timeout_s": 300.0}))
    assert lab.config().run.steps == LAB_STEPS and f"{LAB_STEPS} steps" in lab.status_text
    lab.kind.value, lab.inject_step.value, lab.every.value = "crash", 9, 4
    config = lab.config()
    assert (config.fault.inject, config.fault.inject_step, config.fault.checkpoint_every) == ("crash", 9, 4)
    assert config.fault.max_restarts >= 2 and config.comm.timeout_s == 10.0 and config.fault.inject_rank == 1
    assert lab.config(fault=False).fault.inject == "none"
    lab.steps.value = 40
    assert lab.config().run.steps == 40 and lab.inject_step.max == 39


def test_status_and_outcome_are_plain_text(tmp_path):
    run = _ended_run(tmp_path, faults=[CRASH], restarts=1)
    text = outcome_text(run)
    assert text.splitlines() == [
        "run finished: 10 of 10 steps in 26 s, 1 restart(s)",
        "crash on rank 1 at step 8: resumed at step 5, 3 step(s) recomputed, recovered in 16.5 s"]
    lab = FaultToleranceLab(tiny_config())
    lab._say(text + "\n<b> is not markup")
    assert lab.status_text.endswith("<b> is not markup") and "&lt;b&gt;" in lab.status.value


def test_notebook_prints_no_widget_markup():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert ".status.value" not in code and "outcome_text(" in code


def test_progress_counts_down_and_follows_a_recovery():
    events = [{"type": "step", "step": s, "time": 10 + 0.5 * s} for s in range(20)]
    kill = {"kind": "kill", "rank": 1, "step": 20, "time": 20.0, "resumed_at_step": None, "recovery_s": None}
    assert progress_text([], [], 100).startswith("starting")
    assert "step 20/100, about 40 s of training left" in progress_text(events, [], 100)
    assert progress_text(events, [kill], 100).splitlines()[0] == ("kill on rank 1 at step 20: "
                                                                  "the elastic agent is restarting the group…")
    back = {**kill, "resumed_at_step": 18, "steps_recomputed": 2, "recovery_s": 6.0}
    assert "resumed at step 18, 2 step(s) recomputed, recovered in 6.0 s" in progress_text(events, [back], 100)


def test_a_kill_names_the_step_it_stopped_not_the_last_one_seen(tmp_path):
    """A kill from outside records the last step it saw; if the workers logged more before the signal landed,
    the run stopped later, and the steps recomputed are counted from there."""
    _ended_run(tmp_path, faults=[{"kind": "kill", "rank": 1, "step": 3, "time": 102.5}], restarts=1)
    fault, = recovery_report(tmp_path / "fault-lab-run")  # steps 3..7 were logged after the record
    assert (fault["step"], fault["resumed_at_step"], fault["steps_recomputed"]) == (8, 5, 3)


def test_kill_after_the_run_ended_says_the_run_is_over(tmp_path):
    lab = FaultToleranceLab(tiny_config())
    lab.kill_button.click()
    assert "no live run" in lab.status_text and "Start run" in lab.status_text
    lab.run = _ended_run(tmp_path)
    lab.kill_button.click()  # nothing raises: the status line says why nothing was killed
    assert lab.status_text.startswith("The run is over (finished after 10 steps)"), lab.status_text


def test_compare_after_a_run_without_a_fault_proves_nothing(tmp_path):
    lab = FaultToleranceLab(tiny_config())
    lab.run = _ended_run(tmp_path)  # no fault injected, nobody pressed Kill, no restart
    same, verdict = lab.compare()  # no clean run is started (this test may start no process)
    assert not same and lab.clean is None
    assert verdict.startswith("No fault happened") and "prove nothing about recovery" in verdict
    assert "bit-for-bit" not in lab.status_text and lab.status_text == verdict
    assert "no fault happened" in outcome_text(lab.run)


# ---------------------------------------------------------------- the lab's buttons, on a real run
def _wait_for_step(run, step: int, timeout_s: float = 180) -> None:
    """Until ``run`` logged ``step``, read through a handle of its own (the dashboard's thread reads ``run``)."""
    reader, deadline = open_run(run.run_dir), time.time() + timeout_s
    while not any(e["type"] == "step" and e["step"] >= step for e in reader.events()):
        assert run.status == "running" and time.time() < deadline, f"no step {step}: {run.log()[-2000:]}"
        time.sleep(0.05)


@pytest.mark.multiproc
def test_kill_button_is_followed_to_the_outcome_then_compared():
    lab = FaultToleranceLab(tiny_config(), steps=240)  # a checkpoint every 24 steps: seconds to kill it in
    lab.start_button.click()
    run = lab.run
    assert run is not None and lab.start_button.disabled
    _wait_for_step(run, 30)
    lab.kill_button.click()
    assert lab.status_text.startswith("SIGKILL sent to rank 1"), lab.status_text
    lab.join(timeout=240)  # the watcher ends with the run
    assert run.status == "finished" and not lab.start_button.disabled
    text = lab.status_text
    assert text.startswith("run finished: 240 of 240 steps") and "SIGKILL" not in text, text
    report = recovery_report(run.run_dir)
    assert [f["kind"] for f in report] == ["kill"] and report[0]["resumed_at_step"] >= 24
    assert f"kill on rank 1 at step {report[0]['step']}: resumed at step {report[0]['resumed_at_step']}" in text
    assert f"recovered in {report[0]['recovery_s']:.1f} s" in text
    assert lab.figure.value == render_png(recovery_figure(open_run(run.run_dir).events(), report))  # this run's
    lab.kill_button.click()
    assert lab.status_text.startswith("The run is over (finished after 240 steps)")
    lab.compare_button.click()  # trains the clean run in the background
    lab.join(timeout=240)
    assert lab.status_text.startswith("✔ after kill on rank 1") and "bit-for-bit identical" in lab.status_text
    assert lab.clean.summary["restarts"] == 0
    followers = [t for t in threading.enumerate() if t.name == "labkit-fault-lab" or "(_follow)" in t.name]
    assert followers == []  # the lab's watcher and the dashboard's follower ended with their runs
    assert processes_mentioning(str(run.run_dir)) == [] and processes_mentioning(str(lab.clean.run_dir)) == []
