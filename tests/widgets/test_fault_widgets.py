"""The fault-tolerance lab's pictures (pure functions of events) and its buttons (on real runs)."""
import pytest
import torch

from helpers import tiny_config
from labkit.fault.recovery import attempts, measured_checkpoint_cost, same_parameters, seconds_between_checkpoints
from labkit.widgets.fault import FaultToleranceLab, overhead_figure, recovery_figure


def _events():
    steps = [{"type": "step", "step": s, "loss": 3 - 0.1 * s, "time": 100 + s} for s in range(8)]
    resumed = [{"type": "step", "step": s, "loss": 3 - 0.1 * s, "time": 120 + s} for s in range(5, 10)]
    saves = [{"type": "checkpoint", "step": s, "blocking_s": b, "time": 100 + s} for s, b in ((4, 0.02), (6, 0.04))]
    return [{"type": "start", "time": 99.0}, *steps[:5], saves[0], *steps[5:7], saves[1], steps[7],
            {"type": "resume", "next_step": 5, "time": 119.0}, *resumed]


def test_attempts_split_at_each_resume():
    split = attempts(_events())
    assert [[e["step"] for e in a] for a in split] == [list(range(8)), list(range(5, 10))]


def test_recovery_figure_marks_fault_recovery_and_checkpoints():
    fault = {"kind": "crash", "rank": 1, "step": 8, "time": 108.5, "recovery_s": 11.5}
    fig = recovery_figure(_events(), [fault])
    ax_loss, ax_time = fig.axes
    assert len(ax_loss.lines) == 2 + 2 + 1  # two attempts, two checkpoints, the fault
    labels = ax_time.get_legend_handles_labels()[1]
    assert "crash (rank 1)" in labels and "recovery 11.5 s" in labels


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
    assert same_parameters(a, {k: v.clone() for k, v in a.items()}) == (True, "all 2 tensors (5 numbers) are bit-for-bit identical")
    b = {"w": torch.ones(3).nextafter(torch.tensor(2.0)), "b": torch.zeros(2)}
    same, verdict = same_parameters(a, b)
    assert not same and verdict.startswith("1 of 2 tensors differ")


@pytest.mark.multiproc
def test_lab_buttons_run_a_fault_and_prove_the_recovery():
    lab = FaultToleranceLab(tiny_config(**{"run.steps": 16}))
    lab.kill_button.click()  # nothing running yet: the status line says so, nothing raises
    assert "no live run" in lab.status.value
    lab.kind.value, lab.inject_step.value, lab.every.value = "crash", 9, 4
    config = lab.config()
    assert (config.fault.inject, config.fault.inject_step, config.fault.checkpoint_every) == ("crash", 9, 4)
    assert config.fault.max_restarts >= 1
    run = lab.start()
    summary = lab.wait()
    assert run.status == "finished" and summary["restarts"] == 1
    assert "crash on rank 1 at step 9: resumed at step 8" in lab.status.value
    assert lab.figure.value  # the recovery picture was drawn
    lab.compare_button.click()
    assert "bit-for-bit identical" in lab.status.value, lab.status.value
    assert lab.clean.summary["restarts"] == 0
