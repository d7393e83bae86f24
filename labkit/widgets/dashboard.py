"""A live run dashboard: a headline, and loss, throughput, MFU and communication (in flight, exposed), redrawn
as a run goes, without taking the workers' CPU.

The headline is one line of text (:func:`summary_text`), rewritten at every tick. While the run goes the picture
is a light live sketch (:func:`~labkit.widgets.sketch.sketch_svg`, SVG the browser draws); once it has ended, the
full picture (:func:`~labkit.widgets.dashboard_panels.dashboard_figure`, a pure function of the events) is drawn
here. Another figure is drawn live by a low-priority process (:mod:`labkit.widgets.painter`). Either is shown
on an IPython *display handle* (each redraw replaces the previous one in place, and the last picture stays in
the saved notebook) or in an ipywidgets box. Another picture of the same events can take its place (``figure``:
notebook 13 follows a mixture of experts' routing, :func:`labkit.widgets.moe_panels.routing_figure`).
"""
from __future__ import annotations

import importlib
import threading
import time
from concurrent.futures import wait
from html import escape
from typing import Optional

from labkit.metrics.communication import comm_text
from labkit.metrics.events import final_trajectory
from labkit.metrics.window import headline_window
from labkit.plots import render_png
from labkit.widgets.dashboard_panels import SMOOTH, dashboard_figure, peak_words
from labkit.widgets.painter import BOOST_NICE, LATE_S, frame_gap, painter, timed
from labkit.widgets.sketch import sketch_svg

WAITING = "the dashboard's picture appears after the first step…"
FIGURE = "labkit.widgets.dashboard_panels:dashboard_figure"  # what the painter process draws, by name
EVERY_S = 2.0
"""Seconds between two rewrites of the headline, and between two frames' starts unless a frame costs more
(:func:`~labkit.widgets.painter.frame_gap`); the README states both."""
SVG_MIME = "image/svg+xml"  # how a sketch goes to the page (JupyterLab shows it as an <img>)
LIVE = ("sketch", "painter")  # how the picture is drawn while the run goes (the class says)
FIRST_POLL_S = 0.5  # until the first frame is asked for: the first step's picture asked for soon after it


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_text(events: list[dict]) -> str:
    """One line a projector can show: where the run is and how it is doing: over its last SMOOTH steps while it
    goes, and once it has ended over the steps its summary averages, with the summary's definition
    (:func:`labkit.metrics.window.headline_window`): the ended run's headline says what ``summary.json`` says."""
    steps = final_trajectory(events)
    end = next((e for e in events if e.get("type") == "end"), None)
    state = f" — {end['status']}" if end else ""
    if not steps:
        return f"no step completed{state}" if end else "waiting for the first step…"
    start = next((e for e in events if e.get("type") == "start"), {})
    window, m = headline_window(events, SMOOTH)
    mfu = m["mfu"]
    peak = f" of {peak_words(start['peak_source'])}" if mfu is not None and start.get("peak_source") else ""
    step_s = m["step_time_s"]
    return (f"step {steps[-1]['step'] + 1}/{start.get('steps')}{state} · loss {_fmt(steps[-1]['loss'], '.3f')} · "
            f"{window}: {_fmt(m['tokens_per_s'], ',.0f')} tokens/s, "
            f"MFU {_fmt(mfu and mfu * 100, '.1f')}%{peak}, {comm_text(m['comm_frac'], m['comm_exposed_frac'])} "
            f"of step time, {_fmt(step_s and 1 / step_s, '.2f')} it/s, {_fmt(m['tflops'], '.3g')} TFLOPS")


class RunDashboard:
    """A run's picture and status line, redrawn as the run goes, at little cost to the run.

    Two ways to show it: ``follow(run)`` in a cell puts it on display handles (the last picture is
    saved with the notebook); ``widget`` is an ipywidgets box that can be updated from a background
    thread (what the panels' Run buttons use). Each frame goes to one of them: the display handles once
    :meth:`show` (or ``follow``) made them, else the widget (a widget's every change is a message the page
    handles, shown or not: a frame sent to both would cost the page twice). Either way the status line is
    rewritten at every tick (cheap). While the run goes, the picture is the live sketch
    (:func:`~labkit.widgets.sketch.sketch_svg`: four panels as SVG, a few milliseconds here, redrawn at every
    tick that brought a new event); another ``figure`` (or ``live="painter"``) is drawn by the low-priority
    :func:`~labkit.widgets.painter.painter` process instead: only when a new event arrived, never two at once,
    and spaced by its CPU cost (:func:`~labkit.widgets.painter.frame_gap`), raised a step only while its frames
    come late (:data:`~labkit.widgets.painter.BOOST_NICE`). The final picture (the figure, all of it) is drawn
    here once the
    run has ended.
    """

    def __init__(self, title: str = "", figure: str = FIGURE, live: Optional[str] = None):
        import ipywidgets as W

        from labkit.widgets.picture import Picture

        self.title = title
        self.figure = figure  # "module:function", called as function(events, title): drawn at the end (and live)
        self.live = live or ("sketch" if figure == FIGURE else "painter")  # how the picture is drawn while it goes
        if self.live not in LIVE:
            raise ValueError(f"live={self.live!r}: choose one of {', '.join(LIVE)}")
        self.svg: Optional[str] = None  # the live sketch shown, until the final picture replaces it
        self.events: list[dict] = []
        self.png: Optional[bytes] = None
        self.text = summary_text([])
        self._image_handle = None
        self._text_handle = None
        self._thread: Optional[threading.Thread] = None
        self._frame = None  # the frame the painter is drawing: (future, the events' key)
        self._drawn_key = None  # what the picture shown was drawn from
        self._next_frame_at = 0.0
        self._every_s = EVERY_S
        self._boost = 0  # the step of BOOST_NICE the painter draws at
        self._late_at = float("inf")  # when the frame being drawn is late: the painter a step up then
        self._stats = {"frames": 0, "skipped": 0, "cpu_s": 0.0, "wall_s": 0.0, "intervals": [], "errors": [],
                       "follow_cpu_s": 0.0, "final_cpu_s": 0.0, "boosts": []}
        self.text_widget = W.HTML(self._html())
        self.image_widget = Picture(waiting=WAITING)
        self.sketch_widget = W.HTML(layout=W.Layout(display="none"))
        self.widget = W.VBox([self.text_widget, self.sketch_widget, self.image_widget])

    def _html(self) -> str:
        return f"<div style='font-size:1.25em;font-weight:600;margin:6px 0'>{escape(self.text)}</div>"

    def show(self) -> None:
        """Put the dashboard on display handles in the current cell's output."""
        from IPython.display import HTML, display

        from labkit.widgets.picture import PLACEHOLDER_STYLE

        self._text_handle = display(HTML(self._html()), display_id=True)
        self._image_handle = display(HTML(f"<div style='{PLACEHOLDER_STYLE}'>{escape(WAITING)}</div>"),
                                     display_id=True)

    def update(self, run, final: bool = False) -> None:
        """Read the run's new events, rewrite the status line, and show a frame the painter finished or ask for
        one if it is due. ``final`` (the run has ended: nothing left to disturb): draw the last picture here, now."""
        self.events = run.events()
        label = getattr(run, "label", "")  # a replay says it is one: "recorded on …, date — replay ×8"
        text = f"{label} · {summary_text(self.events)}" if label else summary_text(self.events)
        title = self.title or label
        sketching = self.live == "sketch" and not final and any(e.get("type") == "step" for e in self.events)
        if text != self.text or (final and self.svg is not None):
            self.text = text
            if not sketching:  # while sketching, the headline goes out with the sketch: one update a tick
                self._show_text()
        key = _events_key(self.events)
        if final:
            self._frame = None  # a frame still being drawn is older than this one: dropped
            if key != self._drawn_key:
                frame = timed(_draw, self.events, title, self.figure)
                self._stats["final_cpu_s"] = frame[1]
                self._show_frame(frame, key)
            return
        if sketching:
            self._sketch(key, title)
            return
        if self.live == "sketch":
            return  # the placeholder says what it waits for until there is a step to draw
        if self._frame is not None and self._frame[0].done():
            (future, drawn), self._frame = self._frame, None
            if future.exception() is None:
                self._pace_painter(future.result()[3] - future.result()[2])  # the drawing's wall seconds
                self._show_frame(future.result(), drawn)
            else:  # the painter failed (it is started again on the next request): said, and the run goes on
                self._stats["errors"].append(str(future.exception()))
        if self._frame is not None:  # one frame at a time; one that keeps the viewer waiting: the painter a step up
            if time.time() >= self._late_at:
                self._pace_painter(float("inf"))
                self._late_at = time.time() + LATE_S
            return
        if key == self._drawn_key:
            self._stats["skipped"] += 1  # nothing new to draw
        elif time.time() >= self._next_frame_at:
            try:
                self._frame = (painter().submit(self.figure, run.run_dir / "events.jsonl", title), key)
                self._late_at = time.time() + 2 * LATE_S  # its drawing plus the painter's waking
            except OSError as error:  # no painter process here: no live picture, the last one is still drawn
                self._stats["errors"].append(f"the painter could not start: {error}")
                self._next_frame_at = float("inf")

    def _pace_painter(self, drawn_s: float, step: Optional[int] = None) -> None:
        """A frame whose drawing took longer than :data:`~labkit.widgets.painter.LATE_S` on the wall clock (it waited
        for CPU): the painter one step up :data:`~labkit.widgets.painter.BOOST_NICE`; one drawn in half of that:
        a step down."""
        if step is None:
            step = self._boost + 1 if drawn_s > LATE_S else self._boost - 1 if drawn_s < LATE_S / 2 else self._boost
        step = min(max(step, 0), len(BOOST_NICE) - 1)
        if step != self._boost and painter().set_group_nice(BOOST_NICE[step]):
            self._boost = step
            self._stats["boosts"].append((time.time(), BOOST_NICE[step]))

    def _sketch(self, key, title: str) -> None:
        """The live sketch of the events, if a new one arrived since the last (else a redraw skipped)."""
        if ("sketch", key) == self._drawn_key:  # tagged: the final picture is drawn over a sketch of the same events
            self._stats["skipped"] += 1
            return
        started, cpu = time.time(), time.thread_time()
        svg = sketch_svg(self.events, title, headline=self.text)
        self._count_frame(time.thread_time() - cpu, started, time.time())
        first, self.svg, self._drawn_key = self.svg is None, svg, ("sketch", key)
        if self._image_handle is not None:  # the headline in the sketch, one output: one image for the page to draw
            from IPython.display import HTML

            if first and self._text_handle is not None:
                self._text_handle.update(HTML(""))  # until the run ends, the headline is the sketch's
            self._image_handle.update({SVG_MIME: svg}, raw=True)  # an image: no HTML to parse, no maths to typeset
        else:
            self.text_widget.value = self._html()
            self.sketch_widget.value = svg
            self.sketch_widget.layout.display = None
            self.image_widget.layout.display = "none"

    def _count_frame(self, cpu_s: float, started: float, ended: float) -> None:
        self._stats.update(frames=self._stats["frames"] + 1, cpu_s=self._stats["cpu_s"] + cpu_s,
                           wall_s=self._stats["wall_s"] + ended - started)
        self._stats["intervals"].append((started, ended))

    def _show_frame(self, frame: tuple, key) -> None:
        png, cpu_s, started, ended = frame
        self._next_frame_at = started + frame_gap(self._every_s, cpu_s)
        self._count_frame(cpu_s, started, ended)
        self.png, self._drawn_key = png, key
        if self._image_handle is not None:
            from IPython.display import Image

            self._image_handle.update(Image(data=png, format="png"))
        else:
            self.image_widget.value = png
            self.sketch_widget.layout.display = "none"
            self.image_widget.layout.display = None

    def _show_text(self) -> None:
        if self._text_handle is not None:
            from IPython.display import HTML

            self._text_handle.update(HTML(self._html()))
        else:
            self.text_widget.value = self._html()

    def drawing_stats(self) -> dict:
        """Frames drawn, redraws skipped because nothing had changed, the CPU and wall seconds drawing took (the last
        frame's, drawn here after the run, apart too), each frame's (start, end) on the wall clock, the CPU seconds
        the follow loop itself took here while the run went (``benchmarks/dashboard_cost.py`` reports them), and
        the painter's errors, if any."""
        return {**self._stats, "intervals": list(self._stats["intervals"]), "errors": list(self._stats["errors"])}

    def follow(self, run, every_s: float = EVERY_S) -> Optional[dict]:
        """Rewrite the status line every ``every_s`` seconds and redraw (see the class) until the run ends;
        Ctrl-C / interrupt stops the run."""
        if self._text_handle is None:
            self.show()
        return self._follow(run, every_s)

    def _follow(self, run, every_s: float) -> Optional[dict]:
        self._every_s = every_s
        try:
            if self.live == "painter":
                painter()  # started now, while the workers start: its imports are done by the first frame
        except OSError:
            pass  # no painter process here: update() says so on the first frame it asks for
        cpu = time.thread_time()
        try:
            while run.status == "running":
                self.update(run)
                self._pause(every_s)
        except KeyboardInterrupt:
            run.stop()
            raise
        finally:
            self._stats["follow_cpu_s"] = time.thread_time() - cpu  # here, while the run went
            if self.live == "painter":
                self._pace_painter(0.0, step=0)  # an idle painter back at the lowest priority
        run.wait()
        self.update(run, final=True)
        return run.summary

    def _pause(self, every_s: float) -> None:
        """Until the next tick (``every_s``), or sooner: until the frame being drawn arrives (shown at once, not a
        tick later), or is late, or until the next frame is due (asked for at once); before the first frame, every
        :data:`FIRST_POLL_S` (reading the events file costs little)."""
        if self._frame is None and self._stats["frames"] == 0 and not self._stats["errors"]:
            time.sleep(min(every_s, FIRST_POLL_S))
        elif self._frame is not None:
            wait([self._frame[0]], timeout=max(0.0, min(every_s, self._late_at - time.time())))
        else:  # a due time already past: nothing new to draw, the next tick
            due_in = self._next_frame_at - time.time()
            time.sleep(every_s if due_in <= 0 else min(every_s, due_in))

    def follow_in_background(self, run, every_s: float = EVERY_S) -> threading.Thread:
        """Follow without blocking the notebook, drawing into ``self.widget`` (the Run button's way)."""
        self._thread = threading.Thread(target=self._follow, args=(run, every_s), daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _events_key(events: list[dict]):
    """What a picture drawn from ``events`` depends on, in brief: the newest event (None before any)."""
    last = events[-1] if events else {}
    return (last.get("type"), last.get("time"), last.get("step")) if events else None


def _draw(events: list[dict], title: str, figure: str = FIGURE) -> bytes:
    """``figure`` (``"module:function"``, as the painter takes it) of ``events``, as PNG bytes."""
    if figure == FIGURE:
        return render_png(dashboard_figure(events, title))
    module, name = figure.split(":")
    return render_png(getattr(importlib.import_module(module), name)(events, title))
