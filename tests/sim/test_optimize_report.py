"""The modelled walk as text and figure, and the notebook's 128-GPU example (the scenario's baseline)."""
import pytest

from labkit.sim import optimize_report as rep
from labkit.sim.scenario import LABEL
from labkit.sim.step import StepBreakdown
from labkit.text import too_wide
from labkit.tuning.flowchart import COMMUNICATION_BOUND


@pytest.fixture(scope="module")
def walk():
    return rep.comm_bound_example()


def test_the_example_is_the_scenario_s_communication_bound_baseline_and_ends_faster(walk):
    assert walk.cluster.gpus == 128 and walk.start.precision == "fp32" and walk.start.layout.tp == 1
    assert f"→ {COMMUNICATION_BOUND}:" in walk.decisions[0].reason and walk.speedup > 1


def test_the_text_says_modelled_and_lists_every_decision(walk):
    text = rep.format_walk(walk)
    assert LABEL in text.splitlines()[0] and text.count("modelled") >= 3
    words = " ".join(text.split())  # the reasons are wrapped onto lines of at most PRINT_WIDTH characters
    for d in walk.decisions:
        assert f"{d.iteration:>3} {d.node:<20}" in text and " ".join(d.reason.split()) in words
    assert not too_wide(text)
    assert rep.optimize_text(quick=True) == text  # the model is deterministic


def test_the_verdicts_separate_kept_rejected_and_skipped(walk):
    verdicts = {rep.verdict(d) for d in walk.decisions}
    assert {"—", "kept", "skipped"} <= verdicts
    assert all(rep.verdict(d) == "skipped" for d in walk.decisions if d.candidate and "not modelled" in d.reason)


def test_the_three_groups_are_the_step_s_time_terms():
    grouped = [term for _, terms, _ in rep.GROUPS for term in terms]
    assert sorted(grouped) == sorted(name for name, _ in StepBreakdown.TIME_TERMS)


def test_the_figure_shows_each_kept_configuration_and_is_legible(walk):
    from matplotlib.text import Text

    points = rep.kept_points(walk)
    assert len(points) == 1 + sum(d.kept for d in walk.decisions) and points[-1][1].step == walk.best.step
    fig = rep.walk_figure(walk)
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
    assert fig.get_figwidth() <= 9.5 and min(sizes) >= 12 and "modelled" in fig.axes[0].get_title()
