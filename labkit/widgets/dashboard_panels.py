"""The dashboard's picture: six panels of a run's events, legible at a notebook's width.

A pure function of the events (:func:`dashboard_figure`), so it is tested without a kernel, and drawn live by
the painter process (:mod:`labkit.widgets.painter`), which imports this module and nothing heavier.
"""
from __future__ import annotations

import textwrap
from typing import Optional

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from labkit.metrics.communication import exposed_frac
from labkit.metrics.events import final_trajectory
from labkit.plots import OUTPUT_WIDTH_PX, moving_average

PANELS = [  # (event key, title, y label, scale)
    ("loss", "Loss (nats/token)", "loss", 1.0),
    ("tokens_per_s", "Throughput", "tokens/s", 1.0),
    ("mfu", "MFU", "% of peak", 100.0),
    ("comm_frac", "Comm. in flight & exposed, % of step", "%", 100.0),
]
SMOOTH = 10  # steps in the moving average drawn over noisy panels, and in the headline's live window
FIGSIZE = (OUTPUT_WIDTH_PX / 100, 8.2)  # inches at 100 dpi: shown 1:1 in a notebook's output area
TITLE, LABEL, TICK, LEGEND = 13, 12, 11, 11  # points; at 100 dpi the smallest is 15 px as shown


def dashboard_figure(events: list[dict], title: str = "") -> Figure:
    """Six panels from a run's events, two abreast so they stay legible at a notebook's width: loss (with
    validation and the entropy floor), throughput, MFU (saying what peak it is a share of), communication (in
    flight and exposed) and data-loading shares, each rank's time outside communication (a straggler stands
    out), and peak memory against the device's capacity."""
    steps = final_trajectory(events)  # each step once after a restart (the restart is marked)
    start = next((e for e in events if e.get("type") == "start"), {})
    fig = Figure(figsize=FIGSIZE, dpi=100)
    fig.subplots_adjust(left=0.085, right=0.985, bottom=0.065, top=0.915, wspace=0.26, hspace=0.3)
    axes = fig.subplots(3, 2, sharex=True).ravel()  # one step axis: its numbers on the bottom row only
    x = [e["step"] for e in steps]
    for ax, (key, name, ylabel, scale) in zip(axes, PANELS):
        y = [None if e.get(key) is None else e[key] * scale for e in steps]
        points = [(a, b) for a, b in zip(x, y) if b is not None]
        if points:
            xs, ys = zip(*points)
            noisy = key != "loss" and len(ys) >= 2 * SMOOTH
            ax.plot(xs, ys, lw=1.0 if noisy else 1.5, alpha=0.35 if noisy else 1.0,
                    label={"loss": "train", "comm_frac": None if noisy else "in flight"}.get(key))
            if noisy:
                ax.plot(xs, moving_average(ys, SMOOTH), lw=2.0, color="C0",
                        label="in flight" if key == "comm_frac" else f"mean of {SMOOTH} steps")
        elif steps:
            ax.text(0.5, 0.5, _na_text(key, start.get("peak_source")),
                    ha="center", va="center", transform=ax.transAxes, fontsize=LABEL, color="gray")
        if key == "mfu" and points and start.get("peak_source"):
            _peak_caption(ax, start["peak_source"])
        _style(ax, name, ylabel)
    axes[1].yaxis.set_major_formatter(FuncFormatter(_thousands))
    _exposed_share(axes[3], steps)
    _data_share(axes[3], steps)
    _rank_lanes(axes[4], steps)
    _memory(axes[5], steps, start.get("memory_capacity_bytes"))
    _loss_marks(axes[0], events, start, bool(steps))
    for ax in axes[4:]:
        ax.set_xlabel("step", fontsize=LABEL)
    if steps and start:
        fig.suptitle(title or f"{world_sizes(events)} × {start.get('backend')} on {start.get('device')}",
                     fontsize=TITLE + 1)
    return fig


def world_sizes(events: list[dict]) -> str:
    """The run's world size, or how it changed over its attempts (``4 → 2``: a resume resharded onto fewer ranks)."""
    sizes = [e.get("world_size") for e in events if e.get("type") == "start"]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    return " → ".join(str(size) for size in changes)


def _loss_marks(ax, events: list[dict], start: dict, any_steps: bool) -> None:
    """Validation points, the entropy floor and restarts on the loss panel."""
    evals = [e for e in events if e.get("type") == "eval"]
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation")
    if start.get("entropy_floor"):
        ax.axhline(start["entropy_floor"], ls="--", color="gray", label="entropy floor (exact)")
    labelled = set()
    for resume in (e for e in events if e.get("type") == "resume"):
        label = (f"resharded: {resume['saved_world_size']} → {resume['world_size']} ranks" if resume.get("resharded")
                 else "restart: resumed from checkpoint")
        ax.axvline(resume["next_step"], color="#8172B3" if resume.get("resharded") else "#C44E52", ls=":", lw=2,
                   label=None if label in labelled else label)
        labelled.add(label)
    if any_steps:
        ax.legend(fontsize=LEGEND, loc="upper right")


def _thousands(value: float, _pos=None) -> str:
    return f"{value / 1000:g}k" if abs(value) >= 1000 else f"{value:g}"


def _exposed_share(ax, steps: list[dict]) -> None:
    """Exposed communication (what backward did not hide) beside the share in flight: the part that costs time."""
    shares = [(e["step"], 100 * exposed_frac(e)) for e in steps if exposed_frac(e) is not None]
    if len(shares) >= 2 * SMOOTH:
        ax.plot([s for s, _ in shares], moving_average([v for _, v in shares], SMOOTH), lw=2.0, color="C3",
                label="exposed")
    elif shares:
        ax.plot(*zip(*shares), lw=1.5, color="C3", label="exposed")
    ax.set_ylim(0, 125)  # shares of a step: the legend sits above 100%
    ax.set_yticks([0, 25, 50, 75, 100])


def peak_words(peak_source: str) -> str:
    """What the peak is, without its numbers: "this process's 1-thread fp32 matmul peak (96.9 GFLOP/s: ...)"
    → "this process's 1-thread fp32 matmul peak" (the start event's ``peak_source``, for a caption)."""
    return peak_source.split(" (", 1)[0]


def _na_text(key: str, peak_source: Optional[str]) -> str:
    """What an empty panel says; for MFU, why there is no peak (the start event's ``peak_source``)."""
    if key != "mfu":
        return "n/a"
    if peak_source and peak_source.startswith("n/a"):
        return textwrap.fill(peak_source, 36)
    return "n/a (no peak known\nfor this device)"


def _peak_caption(ax, peak_source: str) -> None:
    """Say what MFU is a percentage of, at the panel's top (room made above the curve): a CPU's measured
    1-thread matmul peak reads differently from a GPU's datasheet peak."""
    ax.set_ylim(0, 1.45 * max(ax.get_ylim()[1], 1e-9))
    ax.text(0.02, 0.96, textwrap.fill(f"% of {peak_words(peak_source)}", 52), transform=ax.transAxes, va="top",
            fontsize=LEGEND, color="dimgray")


def _data_share(ax, steps: list[dict]) -> None:
    shares = [(e["step"], 100 * e["data_s"] / e["step_time_s"]) for e in steps
              if e.get("data_s") is not None and e.get("step_time_s")]
    if shares:
        ax.plot(*zip(*shares), lw=1.5, color="C2", label="data loading")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=LEGEND, loc="upper left", ncol=3, columnspacing=1.0, handlelength=1.5)


def _rank_lanes(ax, steps: list[dict]) -> None:
    """Each rank's busy time per step, over the steps it took part in (a resharded resume changes the world size)."""
    lanes = [e for e in steps if e.get("rank_busy_s")]
    ranks = max((len(e["rank_busy_s"]) for e in lanes), default=0)
    for r in range(ranks):
        mine = [e for e in lanes if len(e["rank_busy_s"]) > r]
        ax.plot([e["step"] for e in mine], [1e3 * e["rank_busy_s"][r] for e in mine], lw=1.5, label=f"rank {r}")
    if lanes:
        ax.set_ylim(0, 1.35 * max(1e3 * max(e["rank_busy_s"]) for e in lanes) or 1.0)  # room for the legend
        ax.legend(fontsize=LEGEND, loc="upper right", ncol=min(ranks, 4))
    _style(ax, "Per rank: time outside comm.", "ms")


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
    ax.set_title(title, fontsize=TITLE, y=1.0)  # placed, not searched for above the axes: a third of a frame
    ax.set_ylabel(ylabel, fontsize=LABEL)
    ax.tick_params(labelsize=TICK)
    ax.yaxis.set_major_locator(MaxNLocator(4))
    ax.grid(alpha=0.3)
