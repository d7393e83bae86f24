"""The dashboard: one definition for its headline and the run's summary, drawing that keeps out of the workers'
way, a picture legible at a notebook's width that says what MFU is a share of, and no broken image."""

import pytest

from labkit.metrics.communication import comm_text
from labkit.metrics.steps import StepTally
from labkit.metrics.window import window_means
from labkit.plots import OUTPUT_WIDTH_PX, illegible_texts, render_png
from labkit.widgets import painter as painting
from labkit.widgets.dashboard import RunDashboard, dashboard_figure, summary_text
from labkit.widgets.picture import Picture

PEAK = ("this process's 1-thread fp32 matmul peak (96.9 GFLOP/s: best of 5 1024×1024 matmuls, measured at load 1.0 "
        "on 2 CPUs, 2026-12-02 13:52)")
START = {"type": "start", "world_size": 2, "backend": "gloo", "device": "cpu", "entropy_floor": 1.48, "steps": 40,
         "peak_source": PEAK, "memory_capacity_bytes": 12_000 * 2**20, "time": 0.0}


def step(s: int, slow: bool = False, **extra) -> dict:
    """A step of 2,048 tokens; a slow one (a redraw stole its core) takes 3× as long and waits in communication."""
    step_s = 0.3 if slow else 0.1
    comm_s = 0.2 if slow else 0.01
    return {"type": "step", "step": s, "time": 1.0 + s, "loss": 2.5 - 0.01 * s, "tokens": 2048,
            "tokens_per_s": 2048 / step_s, "step_time_s": step_s, "comm_s": comm_s, "comm_frac": comm_s / step_s,
            "comm_exposed_s": comm_s, "comm_exposed_frac": comm_s / step_s, "tflops": 0.0061 * 0.1 / step_s,
            "mfu": 0.063 * 0.1 / step_s, "max_mem_bytes": 500 * 2**20, "rank_busy_s": [step_s - comm_s] * 2,
            "rank_comm_s": [comm_s] * 2, "data_s": 0.001, **extra}


def sawtooth_run(n: int = 40, every: int = 5) -> list[dict]:
    """A run whose every ``every``-th step is slow: the sawtooth a redraw used to cut into the curves."""
    return [START, *(step(s, slow=s % every == 0) for s in range(n))]


def summary_of(steps: list[dict]) -> dict:
    tally = StepTally()
    for e in steps:
        tally.add(e)
    return tally.means()


# ---------------------------------------------------------------- one definition: headline = summary

def test_a_windows_rate_is_its_total_work_over_its_total_time_and_a_share_its_seconds_over_its_time():
    fast, slow = step(1), step(2, slow=True)
    m = window_means([fast, slow])
    assert m["tokens_per_s"] == pytest.approx(2 * 2048 / 0.4)  # not the mean of the two steps' rates
    assert m["comm_frac"] == pytest.approx((0.01 + 0.2) / 0.4)  # not the mean of 10% and 67%
    assert m["mfu"] == pytest.approx(0.063 * 0.2 / 0.4) and m["step_time_s"] == pytest.approx(0.2)


def test_the_ended_runs_headline_says_what_its_summary_says():
    events = [*sawtooth_run(), {"type": "end", "status": "finished", "time": 99.0}]
    means = summary_of([e for e in events if e["type"] == "step"])
    text = summary_text(events)
    assert f"{means['tokens_per_s']:,.0f} tokens/s" in text
    assert f"MFU {100 * means['mfu']:.1f}%" in text
    assert comm_text(means["comm_frac"], means["comm_exposed_frac"]) in text
    assert "steps 4–40 (the run's summary)" in text


def test_a_restarted_runs_headline_follows_its_last_attempt_as_the_summary_does():
    first = [START, *(step(s) for s in range(10))]
    second = [dict(START, time=20.0), *(step(s, slow=s % 3 == 0) for s in range(5, 40))]
    events = [*first, {"type": "resume", "next_step": 5}, *second, {"type": "end", "status": "finished"}]
    means = summary_of(second[1:])  # the summary of the attempt that finished the run
    assert f"{means['tokens_per_s']:,.0f} tokens/s" in summary_text(events)
    assert "steps 9–40" in summary_text(events)


def test_the_live_headline_uses_the_same_definition_over_the_last_ten_steps():
    events = sawtooth_run(n=25)
    window = window_means([e for e in events if e.get("type") == "step"][-10:])
    text = summary_text(events)
    assert text.startswith("step 25/40 · loss") and "last 10 steps:" in text
    assert f"{window['tokens_per_s']:,.0f} tokens/s" in text
    assert comm_text(window["comm_frac"], window["comm_exposed_frac"]) in text


# ---------------------------------------------------------------- what MFU is a share of (A8)

def test_mfu_says_what_peak_it_is_a_share_of_in_the_headline_and_on_its_panel():
    events = sawtooth_run(n=25)
    assert "% of this process's 1-thread fp32 matmul peak," in summary_text(events)
    mfu_ax = dashboard_figure(events).axes[2]
    assert any(t.get_text() == "% of this process's 1-thread fp32 matmul peak" for t in mfu_ax.texts)
    assert not any("GFLOP/s" in t.get_text() for t in mfu_ax.texts)  # the peak's particulars stay in the log


# ---------------------------------------------------------------- legible at a notebook's width (A5)

def test_the_dashboard_is_legible_at_the_output_width():
    from PIL import Image
    import io

    events = [*sawtooth_run(), {"type": "eval", "step": 20, "val_loss": 2.3}, {"type": "resume", "next_step": 30}]
    fig = dashboard_figure(events)
    assert illegible_texts(fig) == []
    assert Image.open(io.BytesIO(render_png(fig))).size[0] == OUTPUT_WIDTH_PX  # shown 1:1, never shrunk


# ---------------------------------------------------------------- no broken image before the first frame (A7)

def test_a_run_resharded_onto_fewer_ranks_shows_the_world_size_drop():
    """An elastic run that lost a node resumes on fewer ranks (labkit.fault.reshard): the title says 4 → 2 and the
    loss panel marks the resume as resharded, apart from a plain restart."""
    resume = {"type": "resume", "time": 7.5, "next_step": 4, "world_size": 2, "saved_world_size": 4, "resharded": True}
    events = [dict(START, world_size=4), *(step(s) for s in range(6)), resume, dict(START, world_size=2, time=7.0),
              *(step(s) for s in range(4, 10))]
    fig = dashboard_figure(events)
    assert fig._suptitle.get_text() == "4 → 2 × gloo on cpu"
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "resharded: 4 → 2 ranks" in labels and "restart: resumed from checkpoint" not in labels
    assert dashboard_figure([START, step(0)])._suptitle.get_text() == "2 × gloo on cpu"


def test_the_dashboards_picture_says_what_it_waits_for_until_the_first_frame():
    dashboard = RunDashboard()
    assert isinstance(dashboard.image_widget, Picture) and dashboard.image_widget.showing_placeholder
    assert "after the first step" in dashboard.image_widget.waiting


# ---------------------------------------------------------------- drawing out of the workers' way (A3)

class FakeRun:
    """What the dashboard reads of a run: its directory and its events so far (written to events.jsonl too, for the
    painter process, which reads the file)."""

    def __init__(self, run_dir, events):
        self.run_dir, self.list = run_dir, []
        self.add(*events)

    def add(self, *events):
        import json

        self.list += events
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)

    def events(self):
        return list(self.list)


class FakePainter:
    """Answers at once, as if a frame had cost ``cpu_s``; counts what it was asked."""

    def __init__(self, cpu_s: float):
        self.cpu_s, self.asked = cpu_s, []

    def submit(self, figure, events_path, title=""):
        import time
        from concurrent.futures import Future

        self.asked.append(events_path)
        done = Future()
        done.set_result((b"\x89PNG painted", self.cpu_s, time.time(), time.time() + 0.5))
        return done


def test_a_redraw_waits_for_news_and_for_its_cost_and_the_final_one_is_drawn_here(tmp_path, monkeypatch):
    import labkit.widgets.dashboard as dash

    fake = FakePainter(cpu_s=0.6)
    monkeypatch.setattr(dash, "painter", lambda: fake)
    run = FakeRun(tmp_path, sawtooth_run(n=3))
    dashboard = RunDashboard(live="painter")
    dashboard.update(run)  # asks the painter
    dashboard.update(run)  # shows its frame; nothing newer to ask for
    assert (len(fake.asked) == 1 and dashboard.png == b"\x89PNG painted"
            and not dashboard.image_widget.showing_placeholder)
    dashboard.update(run)  # still nothing new: no frame asked for
    assert len(fake.asked) == 1 and dashboard.drawing_stats()["skipped"] == 2
    run.add(step(3))
    dashboard.update(run)  # news, but the last frame cost 0.6 CPU s: the next waits 0.6 / FRAME_SHARE s
    assert len(fake.asked) == 1 and "step 4/40" in dashboard.text  # ... while the headline moves on at once
    run.add({"type": "end", "status": "finished"})
    dashboard.update(run, final=True)  # the run is over: the last picture is drawn here, whatever the budget
    assert len(fake.asked) == 1 and dashboard.png.startswith(b"\x89PNG") and dashboard.png != b"\x89PNG painted"
    assert dashboard.drawing_stats()["frames"] == 2 and "finished" in dashboard.text


def test_a_frames_cost_spaces_the_next_one():
    assert painting.frame_gap(2.0, 0.05) == 2.0  # cheap frames: as often as asked
    assert painting.frame_gap(2.0, 0.6) == pytest.approx(0.6 / painting.FRAME_SHARE)  # dear ones: less often


def test_the_gaps_between_frames_run_from_the_first_frame_to_the_runs_end():
    assert painting.frame_gaps([3.0, 1.0, 2.5, 9.0], run_end=4.0) == pytest.approx([1.5, 0.5, 1.0])  # 9.0: after
    assert painting.frame_gaps([5.0], run_end=4.0) == []  # no frame while the run went: no gap to speak of
    assert painting.frame_gaps([4.0], run_end=4.0) == [0.0]


def test_a_finished_frame_is_shown_at_once_not_a_tick_later(tmp_path, monkeypatch):
    import threading
    import time
    from concurrent.futures import Future

    import labkit.widgets.dashboard as dash

    dashboard = RunDashboard()
    drawing: Future = Future()
    dashboard._frame = (drawing, None)
    threading.Timer(0.2, lambda: drawing.set_result(None)).start()
    began = time.monotonic()
    dashboard._pause(30.0)  # a 30 s tick: the frame, done after 0.2 s, ends the pause
    assert time.monotonic() - began < 10
    dashboard._frame, dashboard._next_frame_at, dashboard._stats["frames"] = None, time.time() + 0.2, 1
    began = time.monotonic()
    dashboard._pause(30.0)  # the next frame is due in 0.2 s: asked for then, not at the tick
    assert time.monotonic() - began < 10 and dash.EVERY_S == dashboard._every_s


@pytest.mark.multiproc
def test_the_painter_is_another_process_at_the_lowest_priority_and_draws_from_the_events_file(tmp_path):
    import os

    run = FakeRun(tmp_path, sawtooth_run(n=3))
    dashboard = RunDashboard(live="painter")
    dashboard.update(run)
    future, _ = dashboard._frame
    png, cpu_s, started, ended = future.result(timeout=300)
    assert png.startswith(b"\x89PNG") and cpu_s > 0 and ended >= started
    dashboard.update(run)
    assert dashboard.png == png and dashboard.drawing_stats()["frames"] == 1
    me = painting.describe()
    there = painting.painter().describe()
    assert there["pid"] != os.getpid() and there["nice"] == painting.LOWEST and there["own_session"]
    assert me["nice"] != painting.LOWEST  # the kernel keeps its priority
    assert there["idle_class"] == painting.sys.platform.startswith("linux")  # SCHED_IDLE where there is one
    if there["autogroup_nice"] is not None:  # Linux with autogroups
        # its own, niced: the lowest, or a step up if this frame's drawing came late on a busy machine
        assert there["autogroup_nice"] == painting.BOOST_NICE[dashboard._boost]
        assert me["autogroup_nice"] != painting.LOWEST


def test_a_late_frame_raises_the_painter_a_step_and_frames_on_time_lower_it_again(tmp_path, monkeypatch):
    import time
    from concurrent.futures import Future

    import labkit.widgets.dashboard as dash

    class Niced:
        def __init__(self):
            self.set = []

        def set_group_nice(self, value):
            self.set.append(value)
            return True

    niced = Niced()
    monkeypatch.setattr(dash, "painter", lambda: niced)
    dashboard = RunDashboard(live="painter")
    for waited_s in (0.2, 5.0, 5.0, 5.0, 0.7, 0.1, 0.1):  # on time, late ×3, in between, on time ×2
        dashboard._pace_painter(waited_s)
    assert niced.set == [painting.BOOST_NICE[1], painting.BOOST_NICE[2], painting.BOOST_NICE[1],
                         painting.BOOST_NICE[0]]  # never past the last step, never below the lowest priority
    assert painting.BOOST_NICE[0] == painting.LOWEST and list(painting.BOOST_NICE) == sorted(painting.BOOST_NICE,
                                                                                               reverse=True)
    assert [nice for _, nice in dashboard.drawing_stats()["boosts"]] == niced.set
    waiting = RunDashboard(live="painter")
    waiting._frame, waiting._late_at = (Future(), None), time.time() - 0.1  # still being drawn, and late
    waiting.update(FakeRun(tmp_path, sawtooth_run(n=3)))
    assert niced.set[-1] == painting.BOOST_NICE[1] and waiting._frame is not None  # raised while it waits


# ---------------------------------------------------------------- the live sketch

def test_the_live_sketch_draws_the_first_four_panels_as_svg_with_validation_and_restarts():
    from labkit.widgets.dashboard_panels import PANELS
    from labkit.widgets.sketch import CLASS, MAX_POINTS, nice_ticks, sketch_svg, thinned

    resume = {"type": "resume", "time": 7.5, "next_step": 4, "world_size": 2}
    evals = [{"type": "eval", "step": s, "val_loss": 3.0 - 0.1 * s, "time": s} for s in (3, 7)]
    svg = sketch_svg([START, *(step(s) for s in range(6)), resume, *(step(s) for s in range(4, 30)), *evals])
    assert svg.startswith(f'<svg class="{CLASS}"') and svg.endswith("</svg>")
    assert all(name.replace("&", "&amp;") in svg for _, name, _, _ in PANELS)
    assert "validation" in svg and svg.count('stroke-dasharray="4 4"') == 1  # the restart, on the loss panel
    assert "mean of 10" in svg and "steps 0–29" in svg and "2 × gloo on cpu" in svg
    assert "not measured yet" in sketch_svg([START])  # no step yet: empty panels say so
    assert len(thinned([(i, i) for i in range(2000)])) <= MAX_POINTS + 1
    assert thinned([(i, i) for i in range(2000)])[-1] == (1999, 1999)
    assert nice_ticks(0.3, 9.2) == [0, 5, 10] and nice_ticks(1.5, 2.8) == [1.5, 2, 2.5, 3]


class Handle:
    """An IPython display handle as the dashboard uses it: each update's data, kept."""

    def __init__(self):
        self.updates = []

    def update(self, data, raw=False):
        self.updates.append(data)


def test_on_display_handles_each_frame_goes_to_the_page_once_not_also_to_the_hidden_widgets(tmp_path):
    run = FakeRun(tmp_path, sawtooth_run(n=3))
    dashboard = RunDashboard()
    dashboard._text_handle, dashboard._image_handle = Handle(), Handle()  # what show() makes in a notebook
    widgets = (dashboard.text_widget.value, dashboard.sketch_widget.value, dashboard.image_widget.value)
    dashboard.update(run)
    run.add(*sawtooth_run(n=5)[3:])
    dashboard.update(run)
    sketches = dashboard._image_handle.updates
    assert len(sketches) == 2 and sketches[-1] == {"image/svg+xml": dashboard.svg}  # the sketch, one output
    dashboard.update(run, final=True)
    assert dashboard.png.startswith(b"\x89PNG") and len(dashboard._image_handle.updates) == 3
    assert (dashboard.text_widget.value, dashboard.sketch_widget.value, dashboard.image_widget.value) == widgets


def test_the_default_dashboard_sketches_live_without_the_painter_and_draws_the_full_picture_at_the_end(
        tmp_path, monkeypatch):
    import labkit.widgets.dashboard as dash

    def no_painter():
        raise AssertionError("the live sketch needs no painter process")

    monkeypatch.setattr(dash, "painter", no_painter)
    run = FakeRun(tmp_path, sawtooth_run(n=3))
    dashboard = RunDashboard()
    dashboard.update(run)
    assert dashboard.svg.startswith("<svg") and dashboard.sketch_widget.value == dashboard.svg
    assert "step 3/40" in dashboard.text_widget.value  # the headline, rewritten with the sketch
    assert ">step 3/40" in dashboard.svg  # and on top of it: one output for a notebook's display handle
    assert dashboard.png is None and dashboard.image_widget.layout.display == "none"
    dashboard.update(run)  # nothing new: not drawn again
    assert dashboard.drawing_stats()["frames"] == 1 and dashboard.drawing_stats()["skipped"] == 1
    dashboard.update(run, final=True)  # the same events: the full picture replaces the sketch all the same
    assert dashboard.png.startswith(b"\x89PNG") and dashboard.sketch_widget.layout.display == "none"
    assert dashboard.image_widget.layout.display is None and dashboard.drawing_stats()["frames"] == 2
    with pytest.raises(ValueError, match="live='video'"):
        RunDashboard(live="video")
    assert RunDashboard(figure="labkit.widgets.moe_panels:routing_figure").live == "painter"
