"""A live run dashboard: loss, throughput, MFU and communication (in flight, exposed), redrawn as a run goes.

The picture is a matplotlib figure rendered to PNG and shown on an IPython *display handle*:
each redraw replaces the previous one in place, and the last picture stays in the saved
notebook. Drawing is a pure function of the events (:func:`dashboard_figure`), so it is tested
without a kernel.
"""
from __future__ import annotations

import textwrap
import threading
import time
from typing import Optional

from matplotlib.figure import Figure

from labkit.metrics.communication import comm_text, exposed_frac
from labkit.metrics.events import final_trajectory
from labkit.plots import moving_average, render_png

PANELS = [  # (event key, title, y label, scale)
    ("loss", "Loss (nats/token)", "loss", 1.0),
    ("tokens_per_s", "Throughput", "tokens/s", 1.0),
    ("mfu", "Model FLOPs utilization", "% of peak", 100.0),
    ("comm_frac", "Communication in flight, exposed (and data): % of step", "%", 100.0),
]

SMOOTH = 10  # steps in the moving average drawn over noisy panels


def dashboard_figure(events: list[dict], title: str = "") -> Figure:
    """Six panels from a run's events: loss (with validation and the entropy floor), throughput, MFU,
    communication (in flight and exposed) and data-loading shares, each rank's time outside communication (a straggler stands
    out), and peak memory against the device's capacity."""
    steps = final_trajectory(events)  # each step once after a restart (the restart is marked)
    start = next((e for e in events if e.get("type") == "start"), {})
    fig = Figure(figsize=(16, 7.5), dpi=100, layout="constrained")  # sized for a projector
    axes = fig.subplots(2, 3).ravel()
    x = [e["step"] for e in steps]
    for ax, (key, name, ylabel, scale) in zip(axes, PANELS):
        y = [None if e.get(key) is None else e[key] * scale for e in steps]
        points = [(a, b) for a, b in zip(x, y) if b is not None]
        if points:
            xs, ys = zip(*points)
            noisy = key != "loss" and len(ys) >= 2 * SMOOTH
            ax.plot(xs, ys, lw=1.0 if noisy else 1.5, alpha=0.35 if noisy else 1.0,
                    label={"loss": "train", "comm_frac": "communication in flight"}.get(key))
            if noisy:
                ax.plot(xs, moving_average(ys, SMOOTH), lw=2.0, color="C0", label=f"mean of {SMOOTH} steps")
        elif steps:
            ax.text(0.5, 0.5, _na_text(key, start.get("peak_source")),
                    ha="center", va="center", transform=ax.transAxes, fontsize=14, color="gray")
        if key == "mfu" and points and start.get("peak_source"):
            _peak_caption(ax, start["peak_source"])
        _style(ax, name, ylabel)
    _exposed_share(axes[3], steps)
    _data_share(axes[3], steps)
    _rank_lanes(axes[4], steps)
    _memory(axes[5], steps, start.get("memory_capacity_bytes"))
    loss_ax = axes[0]
    evals = [e for e in events if e.get("type") == "eval"]
    if evals:
        loss_ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation")
    if start.get("entropy_floor"):
        loss_ax.axhline(start["entropy_floor"], ls="--", color="gray", label="entropy floor (exact)")
    for i, resume in enumerate(e for e in events if e.get("type") == "resume"):
        loss_ax.axvline(resume["next_step"], color="#C44E52", ls=":", lw=2,
                        label="restart: resumed from checkpoint" if i == 0 else None)
    if steps:
        loss_ax.legend(fontsize=12)
    if steps and start:
        fig.suptitle(title or f"{start.get('world_size')} × {start.get('backend')} on {start.get('device')}",
                     fontsize=16)
    return fig


def _exposed_share(ax, steps: list[dict]) -> None:
    """Exposed communication (what backward did not hide) beside the share in flight: the part that costs time."""
    shares = [(e["step"], 100 * exposed_frac(e)) for e in steps if exposed_frac(e) is not None]
    if len(shares) >= 2 * SMOOTH:
        ax.plot([s for s, _ in shares], moving_average([v for _, v in shares], SMOOTH), lw=2.0, color="C3",
                label=f"exposed (mean of {SMOOTH} steps)")
    elif shares:
        ax.plot(*zip(*shares), lw=1.5, color="C3", label="exposed")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=11)


def _na_text(key: str, peak_source: Optional[str]) -> str:
    """What an empty panel says; for MFU, why there is no peak (the start event's ``peak_source``)."""
    if key != "mfu":
        return "n/a"
    if peak_source and peak_source.startswith("n/a"):
        return textwrap.fill(peak_source, 40)
    return "n/a (no peak known for this device)"


def _peak_caption(ax, peak_source: str) -> None:
    """Say what MFU is a percentage of: a CPU's measured matmul peak reads differently from a datasheet's."""
    ax.text(0.02, 0.03, textwrap.fill(f"% of {peak_source}", 60), transform=ax.transAxes, fontsize=9,
            color="dimgray", va="bottom", bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none"})


def _data_share(ax, steps: list[dict]) -> None:
    shares = [(e["step"], 100 * e["data_s"] / e["step_time_s"]) for e in steps
              if e.get("data_s") is not None and e.get("step_time_s")]
    if shares:
        ax.plot(*zip(*shares), lw=1.5, color="C2", label="data loading")
        ax.legend(fontsize=11)


def _rank_lanes(ax, steps: list[dict]) -> None:
    lanes = [e for e in steps if e.get("rank_busy_s")]
    for r in range(max((len(e["rank_busy_s"]) for e in lanes), default=0)):
        ax.plot([e["step"] for e in lanes], [1e3 * e["rank_busy_s"][r] for e in lanes], lw=1.5, label=f"rank {r}")
    if lanes:
        ax.legend(fontsize=11)
    _style(ax, "Per rank: time outside communication", "ms")


def _memory(ax, steps: list[dict], capacity) -> None:
    peaks = [(e["step"], e["max_mem_bytes"]) for e in steps if e.get("max_mem_bytes")]
    if peaks and capacity:
        ax.plot([s for s, _ in peaks], [100 * b / capacity for _, b in peaks], lw=2, color="C3")
        _style(ax, f"Peak memory: {peaks[-1][1] / 2**20:,.0f} of {capacity / 2**20:,.0f} MiB", "% of capacity")
    else:
        if peaks:
            ax.plot([s for s, _ in peaks], [b / 2**20 for _, b in peaks], lw=2, color="C3")
        _style(ax, "Peak memory", "MiB")


def _style(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=15)
    ax.set_xlabel("step", fontsize=13)
    ax.set_ylabel(ylabel, fontsize=13)
    ax.tick_params(labelsize=12)
    ax.grid(alpha=0.3)


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _recent_mean(steps: list[dict], key: str, n: int = SMOOTH) -> Optional[float]:
    values = [e[key] for e in steps[-n:] if e.get(key) is not None]
    return sum(values) / len(values) if values else None


def summary_text(events: list[dict]) -> str:
    """One line a projector can show: where the run is and how it is doing (mean of recent steps)."""
    steps = final_trajectory(events)
    end = next((e for e in events if e.get("type") == "end"), None)
    state = f" — {end['status']}" if end else ""
    if not steps:
        return f"no step completed{state}" if end else "waiting for the first step…"
    total = next((e.get("steps") for e in events if e.get("type") == "start"), None)
    mfu = _recent_mean(steps, "mfu")
    comm = _recent_mean(steps, "comm_frac")
    exposed = _recent_mean([{"share": exposed_frac(e)} for e in steps], "share")
    step_s = _recent_mean(steps, "step_time_s")
    return (f"step {steps[-1]['step'] + 1}/{total}{state} · loss {_fmt(steps[-1]['loss'], '.3f')} · "
            f"last {min(SMOOTH, len(steps))} steps: {_fmt(_recent_mean(steps, 'tokens_per_s'), ',.0f')} tokens/s, "
            f"MFU {_fmt(mfu and mfu * 100, '.1f')}%, {comm_text(comm, exposed)} of step time, "
            f"{_fmt(step_s and 1 / step_s, '.2f')} it/s, {_fmt(_recent_mean(steps, 'tflops'), '.3g')} TFLOPS")


class RunDashboard:
    """A run's picture and status line, redrawn as the run goes.

    Two ways to show it: ``follow(run)`` in a cell puts it on display handles (the last picture is
    saved with the notebook); ``widget`` is an ipywidgets box that can be updated from a background
    thread (what the panel's Run button uses).
    """

    def __init__(self, title: str = ""):
        import ipywidgets as W

        self.title = title
        self.events: list[dict] = []
        self.png: Optional[bytes] = None
        self.text = summary_text([])
        self._image_handle = None
        self._text_handle = None
        self._thread: Optional[threading.Thread] = None
        self.text_widget = W.HTML(self._html())
        self.image_widget = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.widget = W.VBox([self.text_widget, self.image_widget])

    def _html(self) -> str:
        return f"<div style='font-size:1.25em;font-weight:600;margin:6px 0'>{self.text}</div>"

    def show(self) -> None:
        """Put the dashboard on display handles in the current cell's output."""
        from IPython.display import HTML, display

        self._text_handle = display(HTML(self._html()), display_id=True)
        self._image_handle = display(HTML(""), display_id=True)

    def update(self, run) -> None:
        from IPython.display import HTML, Image

        self.events = run.events()
        self.text = summary_text(self.events)
        self.png = render_png(dashboard_figure(self.events, self.title))
        self.text_widget.value = self._html()
        self.image_widget.value = self.png
        if self._text_handle is not None:
            self._text_handle.update(HTML(self._html()))
            self._image_handle.update(Image(data=self.png, format="png"))

    def follow(self, run, every_s: float = 2.0) -> Optional[dict]:
        """Redraw every ``every_s`` seconds until the run ends; Ctrl-C / interrupt stops the run.

        Drawing costs the notebook's process some CPU, which on a 2-core machine the workers feel:
        every 2 s is a fair compromise.
        """
        if self._text_handle is None:
            self.show()
        return self._follow(run, every_s)

    def _follow(self, run, every_s: float) -> Optional[dict]:
        try:
            while run.status == "running":
                self.update(run)
                time.sleep(every_s)
        except KeyboardInterrupt:
            run.stop()
            raise
        run.wait()
        self.update(run)
        return run.summary

    def follow_in_background(self, run, every_s: float = 2.0) -> threading.Thread:
        """Follow without blocking the notebook, drawing into ``self.widget`` (the Run button's way)."""
        self._thread = threading.Thread(target=self._follow, args=(run, every_s), daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
