"""Widget callbacks, driven the way a person drives them: by setting .value and clicking."""
import time

import pytest

from helpers import tiny_config
from labkit.launcher import _alive
from labkit.plots import render_png
from labkit.widgets import ConfigPanel, RunDashboard, dashboard_figure, summary_text

EVENTS = [
    {"type": "start", "world_size": 2, "backend": "gloo", "device": "cpu", "entropy_floor": 1.48, "steps": 3},
    *({"type": "step", "step": i, "loss": 2.5 - 0.1 * i, "tokens_per_s": 1000.0 + i, "mfu": 0.2,
       "comm_frac": 0.1, "step_time_s": 0.1} for i in range(3)),
    {"type": "eval", "step": 2, "val_loss": 2.4},
]


def test_panel_value_changes_reach_the_config():
    panel = ConfigPanel(tiny_config(), nproc=2)
    panel.n_layer.value = 3
    panel.n_embd.value = 64
    panel.precision.value = "bf16"
    panel.steps.value = 25
    cfg = panel.config()
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.precision.mode, cfg.run.steps) == (3, 64, "bf16", 25)
    assert "process(es)" in panel.status.value and not panel.run_button.disabled


def test_panel_explains_an_impossible_config_and_disables_run():
    panel = ConfigPanel(tiny_config(**{"data.batch_size": 8, "data.micro_batch_size": 4}), nproc=2)
    assert not panel.run_button.disabled
    panel.nproc.value = 3  # 8 sequences do not split over 3 processes
    assert panel.run_button.disabled
    assert "Cannot run" in panel.status.value
    assert "batch of 8 sequences cannot be split evenly over 3 processes: try 1 or 2 or 4" in panel.status.value
    panel.nproc.value = 2
    assert not panel.run_button.disabled and "Cannot run" not in panel.status.value


def test_panel_status_counts_parameters_of_the_real_vocabulary():
    panel = ConfigPanel(tiny_config(), nproc=1)
    panel.n_layer.value = 1
    panel.n_embd.value = 32
    from labkit.model import GPTShape, count_params

    cfg = panel.config()
    expected = count_params(GPTShape.from_config(cfg.model, vocab_size=16))["total"]
    assert f"{expected / 1e6:.2f} M parameters" in panel.status.value


@pytest.mark.multiproc
def test_run_and_stop_buttons_drive_a_real_run():
    panel = ConfigPanel(tiny_config(**{"run.steps": 100000}), nproc=2)
    panel.run_button.click()
    assert panel.run is not None and panel.run_button.disabled and not panel.stop_button.disabled
    deadline = time.time() + 60
    while len(panel.dashboard.events) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert any(e["type"] == "step" for e in panel.dashboard.events)  # the dashboard is following live
    assert panel.output.children == (panel.dashboard.widget,)  # drawn below the panel, not in a log
    assert "step" in panel.dashboard.text_widget.value  # the headline follows at once (the picture: below)
    workers = panel.run.worker_pids
    panel.stop_button.click()
    assert panel.run.status == "stopped" and not any(_alive(p) for p in workers)
    panel.dashboard.join(timeout=60)  # the last picture is drawn once the run has stopped, however loaded the CPU
    assert bytes(panel.dashboard.image_widget.value).startswith(b"\x89PNG") and "stopped" in panel.dashboard.text
    time.sleep(0.5)
    assert not panel.run_button.disabled and panel.stop_button.disabled


def test_dashboard_figure_draws_every_panel():
    fig = dashboard_figure(EVENTS)
    loss_ax, tok_ax, mfu_ax, comm_ax, rank_ax, mem_ax = fig.axes
    assert list(loss_ax.lines[0].get_ydata()) == [2.5, 2.4, 2.3]
    assert any(line.get_label() == "validation" for line in loss_ax.lines)
    assert any(line.get_label() == "entropy floor (exact)" for line in loss_ax.lines)
    assert list(mfu_ax.lines[0].get_ydata()) == [20.0, 20.0, 20.0]
    assert render_png(fig).startswith(b"\x89PNG")


def test_dashboard_shows_rank_lanes_data_share_and_memory_against_capacity():
    start = {"type": "start", "memory_capacity_bytes": 400 * 2**20}
    steps = [{"type": "step", "step": s, "loss": 2.0, "tokens_per_s": 1.0, "mfu": None, "comm_frac": 0.2,
              "data_s": 0.01, "step_time_s": 0.1, "max_mem_bytes": 100 * 2**20, "rank_busy_s": [0.02, 0.05]}
             for s in range(3)]
    _, _, _, comm_ax, rank_ax, mem_ax = dashboard_figure([start, *steps]).axes
    assert [line.get_label() for line in rank_ax.lines] == ["rank 0", "rank 1"]
    assert list(rank_ax.lines[1].get_ydata()) == [50.0, 50.0, 50.0]
    assert list(comm_ax.lines[-1].get_ydata()) == [10.0, 10.0, 10.0] and comm_ax.lines[-1].get_label() == "data loading"
    assert list(mem_ax.lines[0].get_ydata()) == [25.0, 25.0, 25.0] and "of 400" in mem_ax.get_title()


def test_a_run_resharded_onto_fewer_ranks_draws_each_rank_over_the_steps_it_took_part_in():
    def step(s, busy):
        return {"type": "step", "step": s, "loss": 2.0, "tokens_per_s": 1.0, "mfu": None, "comm_frac": 0.2,
                "rank_busy_s": busy}
    events = [{"type": "start", "world_size": 2, "backend": "gloo", "device": "cpu"}, step(0, [0.02, 0.03]),
              step(1, [0.02, 0.03]), {"type": "start", "world_size": 1, "backend": "gloo", "device": "cpu"},
              {"type": "resume", "next_step": 1, "saved_world_size": 2, "world_size": 1, "resharded": True},
              step(1, [0.04]), step(2, [0.04])]
    fig = dashboard_figure(events)
    rank_ax = fig.axes[4]
    assert list(rank_ax.lines[0].get_xdata()) == [0, 1, 2] and list(rank_ax.lines[0].get_ydata()) == [20.0, 40.0, 40.0]
    assert list(rank_ax.lines[1].get_xdata()) == [0]  # rank 1's one step before the node was lost
    assert fig._suptitle.get_text() == "2 → 1 × gloo on cpu"


def test_a_restarted_run_is_drawn_once_along_the_resumed_attempt_with_the_restart_marked():
    lost = [{"type": "step", "step": s, "loss": 9.0, "tokens_per_s": 1.0, "mfu": 0.2, "comm_frac": 0.1}
            for s in (3, 4)]
    resumed = [{"type": "resume", "next_step": 3},
               *({"type": "step", "step": s, "loss": 2.0, "tokens_per_s": 1.0, "mfu": 0.2, "comm_frac": 0.1}
                 for s in (3, 4, 5))]
    loss_ax = dashboard_figure([*EVENTS, *lost, *resumed]).axes[0]
    assert list(loss_ax.lines[0].get_xdata()) == [0, 1, 2, 3, 4, 5]
    assert list(loss_ax.lines[0].get_ydata()) == [2.5, 2.4, 2.3, 2.0, 2.0, 2.0]
    assert any(line.get_label() == "restart: resumed from checkpoint" for line in loss_ax.lines)


def test_dashboard_says_na_when_mfu_is_undefined():
    events = [dict(e, mfu=None) if e["type"] == "step" else e for e in EVENTS]
    mfu_ax = dashboard_figure(events).axes[2]
    assert not mfu_ax.lines and "n/a" in mfu_ax.texts[0].get_text()
    assert "MFU n/a" in summary_text(events)


def test_noisy_panels_get_a_moving_average():
    from labkit.plots import moving_average
    from labkit.widgets.dashboard import SMOOTH

    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    events = [EVENTS[0]] + [{"type": "step", "step": i, "loss": 2.0, "tokens_per_s": float(i % 2), "mfu": 0.1,
                             "comm_frac": 0.1} for i in range(2 * SMOOTH)]
    tok_ax = dashboard_figure(events).axes[1]
    assert len(tok_ax.lines) == 2 and tok_ax.lines[1].get_ydata()[-1] == pytest.approx(0.5)


def test_summary_text():
    assert summary_text([]) == "waiting for the first step…"
    assert summary_text(EVENTS).startswith("step 3/3 · loss 2.300 · last 3 steps: 1,001 tokens/s, MFU 20.0%")
    assert summary_text([dict(e, step_time_s=0.5, tflops=0.25) if e["type"] == "step" else e
                         for e in EVENTS]).endswith("2.00 it/s, 0.25 TFLOPS")
    assert summary_text([{"type": "end", "status": "stopped"}]) == "no step completed — stopped"


def test_summary_text_and_dashboard_show_communication_in_flight_and_exposed():
    events = [dict(e, comm_frac=0.6, comm_exposed_frac=0.05) if e["type"] == "step" else e for e in EVENTS]
    assert "communication in flight 60.0% (exposed 5.0%) of step time" in summary_text(events)
    older = [dict(e, comm_exposed_s=0.02) if e["type"] == "step" else e for e in EVENTS]  # no comm_exposed_frac
    assert "communication in flight 10.0% (exposed 20.0%)" in summary_text(older)
    assert "(exposed n/a)" in summary_text(EVENTS)  # not measured: said, not hidden
    comm_ax = dashboard_figure(events).axes[3]
    assert "in flight" in comm_ax.get_title() and "exposed" in comm_ax.get_title()
    lines = {line.get_label(): list(line.get_ydata()) for line in comm_ax.lines}
    assert lines["in flight"] == pytest.approx([60.0] * 3)
    assert lines["exposed"] == pytest.approx([5.0] * 3)


def test_panel_picks_a_micro_batch_that_divides_evenly():
    panel = ConfigPanel(tiny_config(**{"data.batch_size": 8, "data.micro_batch_size": 4}), nproc=2)
    panel.batch_size.value = 24
    panel.nproc.value = 3  # 8 sequences each: micro-batch 4, two accumulation steps
    assert panel.config().data.micro_batch_size == 4 and not panel.run_button.disabled
    panel.batch_size.value = 48
    panel.nproc.value = 4  # 12 each: micro-batch 4 (divides 12)
    assert panel.config().data.micro_batch_size == 4 and not panel.run_button.disabled


@pytest.mark.multiproc
def test_dashboard_follow_renders_the_final_picture(tmp_path):
    import labkit

    run = labkit.launch(tiny_config(**{"run.steps": 4}), nproc=1, run_dir=tmp_path / "run")
    dash = RunDashboard()
    summary = dash.follow(run, every_s=0.2)
    assert summary["status"] == "finished"
    assert dash.png.startswith(b"\x89PNG") and "finished" in dash.text
