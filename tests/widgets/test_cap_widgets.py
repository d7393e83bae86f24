"""The CAP lab's figures (pure, from synthetic logs) and its widget callbacks on live runs."""
from pathlib import Path

import pytest

from helpers import tiny_config
from labkit.consistency.report import availability_kept, consistency_kept, verdict
from labkit.widgets.cap import CapLab, comparison_figure, divergence_figure, progress_figure


def _records(spans, busy=0.05):
    return [{"step": i + 1, "t_start": a, "t_end": b, "busy_s": busy, "loss": 3.0 - 0.01 * i}
            for i, (a, b) in enumerate(spans)]


def _summary(mode, steps_other, busy_in, divergence, **extra):
    return {"status": "finished", "consistency": mode, "partition": [1.0, 2.0], "partition_rank": 1,
            "steps_in_partition": {"1": 0, "2": steps_other},
            "availability": {"1": {"busy_in_partition": 0.0, "busy_outside_partition": 0.5},
                             "2": {"busy_in_partition": busy_in, "busy_outside_partition": 0.5}},
            "busy_in_partition": busy_in / 2, "busy_fraction": 0.4, "divergence_max": divergence,
            "divergence_max_in_partition": divergence, "divergence_relative_max": divergence / 10,
            "recovery_s": 0.1, "final_loss": 2.0, **extra}


def test_the_verdict_names_what_each_mode_gave_up_with_its_numbers():
    sync = _summary("sync", 0, 0.0, 0.0)
    assert availability_kept(sync) == "gave up" and consistency_kept(sync) == "kept"
    text = verdict(sync)
    assert "gave up <b>A</b>" in text and "kept <b>C</b>" in text and "0 step(s)" in text
    run_on = _summary("async", 40, 0.45, 0.3, staleness_max=12)
    assert availability_kept(run_on) == "kept" and consistency_kept(run_on) == "gave up"
    assert "kept <b>A</b>" in verdict(run_on) and "12 clocks stale" in verdict(run_on)
    bounded = _summary("ssp", 3, 0.1, 0.2, staleness_bound=2, staleness_max=2)
    assert availability_kept(bounded) == "partly" and "staleness ≤ s = 2" in verdict(bounded)
    assert "did not finish" in verdict({"consistency": "sync", "status": "failed", "error": "boom"})


def test_figures_draw_progress_divergence_and_the_trade_off():
    workers = {0: _records([(0, 0.5), (0.5, 2.2), (2.2, 2.5)]), 1: _records([(0, 0.5), (0.5, 2.2), (2.2, 2.5)])}
    fig = progress_figure(workers, (1.0, 2.0))
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 2 and ax.get_legend_handles_labels()[1][0] == "partition"
    series = [{"t": 0.5, "max": 0.0, "mean": 0.0}, {"t": 2.2, "max": 0.1, "mean": 0.05}]
    fig = divergence_figure(series, (1.0, 2.0), [{"staleness": 0}, {"staleness": 2}, {"staleness": 2}])
    assert [b.get_height() for b in fig.axes[1].patches] == [1, 2]
    fig = comparison_figure([(_summary("sync", 0, 0.0, 0.0), workers), (_summary("async", 9, 0.4, 0.3), workers)])
    loss_ax, steps_ax, trade_ax = fig.axes[:3]
    assert len(loss_ax.get_lines()) == 2 and list(steps_ax.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert [t.get_text() for t in trade_ax.texts] == ["sync", "async"]
    assert trade_ax.collections[0].get_offsets()[0][0] == 0.0  # sync: no computing during the partition


@pytest.mark.multiproc
def test_run_button_trains_live_and_compare_places_modes_on_the_trade_off(tmp_path):
    lab = CapLab(tiny_config(**{"run.runs_dir": str(tmp_path), "optim.lr": 0.3}), quick=True)
    lab.mode.value, lab.duration.value, lab.start.value, lab.length.value = "sync", 2.5, 0.8, 0.8
    lab.run_button.click()
    assert "gave up <b>A</b>" in lab.status.value, lab.status.value
    assert lab.progress.value[:4] == b"\x89PNG" and lab.details.value[:4] == b"\x89PNG"
    assert lab.summaries[-1]["consistency"] == "sync" and lab.summaries[-1]["partition"] == [0.8, 1.6]
    summaries = lab.compare(modes=("sync", "async"))
    assert [s["consistency"] for s in summaries] == ["sync", "async"] and lab.comparison.value[:4] == b"\x89PNG"
    assert "kept <b>A</b>" in lab.status.value and list(Path(tmp_path).glob("cap-comparison-*.json"))


def test_a_partition_outside_the_run_is_refused_in_the_status_line(tmp_path):
    lab = CapLab(tiny_config(**{"run.runs_dir": str(tmp_path)}), quick=True)
    lab.duration.value, lab.start.value, lab.length.value = 3.0, 2.0, 2.0
    lab.run_button.click()
    assert "Failed" in lab.status.value and "longer than the run" in lab.status.value
    assert not list(Path(tmp_path).glob("*/summary.json"))  # refused before any worker started


@pytest.mark.multiproc
def test_interrupting_a_live_run_ends_every_worker(tmp_path, monkeypatch):
    """Ctrl-C in the notebook while the lab redraws: the run is stopped, no worker is left behind."""
    import pytest

    import labkit.widgets.cap as cap

    lab = CapLab(tiny_config(**{"run.runs_dir": str(tmp_path)}), quick=True)
    lab.mode.value, lab.duration.value, lab.length.value = "async", 30.0, 0.0
    import time
    from types import SimpleNamespace

    calls = []

    def interrupted_sleep(seconds):
        calls.append(seconds)
        time.sleep(seconds)
        if any(cap.measure.load_progress(lab.live.run_dir).values()) or len(calls) > 60:
            raise KeyboardInterrupt  # once the workers are training

    # only the lab's own clock is patched: the launcher's stop() must sleep normally
    monkeypatch.setattr(cap, "time", SimpleNamespace(sleep=interrupted_sleep, strftime=time.strftime))
    with pytest.raises(KeyboardInterrupt):
        lab.run()
    assert lab.live.status == "stopped" and "interrupted" in lab.status.value
    pids = lab.live.worker_pids
    assert len(pids) == 3 and len(calls) <= 60

    from labkit.launcher import _alive  # a zombie awaiting its reaper counts as ended
    assert not [pid for pid in pids if _alive(pid)]


def test_a_run_with_other_settings_leaves_the_panel_showing_what_run_will_run(tmp_path):
    """Notebook cells pass their settings to run(): the sliders keep the panel's own choice (they used to end Run
    All showing the last cell's straggler settings)."""
    lab = CapLab(tiny_config(**{"run.runs_dir": str(tmp_path)}), quick=True)
    before = {name: getattr(lab, name).value for name in ("mode", "staleness", "length", "straggler", "workers")}
    cfg = lab.config("ssp", staleness=4, length=0.0, straggler=3.0)
    assert (cfg.comm.consistency, cfg.comm.staleness, cfg.comm.partition_s, cfg.comm.partition_rank) == ("ssp", 4, 0.0,
                                                                                                         None)
    assert (cfg.comm.slow_factor, cfg.comm.slow_rank) == (3.0, 2)  # rank 0 is the server: the last worker is 2
    assert {name: getattr(lab, name).value for name in before} == before
    assert lab.config().comm.consistency == before["mode"] and lab.config().comm.slow_rank is None
    with pytest.raises(ValueError, match="unknown setting.*partition_s.*choose from mode, workers"):
        lab.settings(partition_s=0.0)


def test_the_notebook_never_moves_the_panels_sliders():
    import json
    import re

    notebook = Path(__file__).resolve().parents[2] / "notebooks" / "01_cap_tradeoffs.ipynb"
    code = "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                     if c["cell_type"] == "code")
    assert "lab.run(" in code and re.findall(r"\blab\.\w+\.value\s*=|\blab\.\w+\.value\s*,.*=", code) == []
