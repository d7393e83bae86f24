"""The CAP lab: choose a consistency model, cut a worker off, and watch availability and consistency trade.

``CapLab`` starts a live run of 2–4 workers (plus a parameter server for ``ssp`` / ``async``) with
the partition and straggler set by its sliders, draws each worker's progress while it runs, and
afterwards the divergence between replicas and the staleness of updates. **Compare all modes**
runs the four models under the same partition and places each on availability against
consistency, with the final loss as colour. The figures are pure functions of a run's logs
(:mod:`labkit.consistency.measure`), tested without a kernel.

The sliders always show what **Run** will run: a notebook cell that runs other settings passes them to
:meth:`CapLab.run` (``lab.run("ssp", staleness=4)``) instead of moving the sliders.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import ipywidgets as W
from matplotlib import cm
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.config import Config, from_dict
from labkit.consistency import measure, processes_for
from labkit.consistency.report import comparison_rows, verdict
from labkit.plots import FIGURE_WIDTH, label_axes, moving_average, render_png
from labkit.text import plain, wrap
from labkit.widgets.picture import Picture

MODES = ("sync", "local_sgd", "ssp", "async")
SETTINGS = ("mode", "workers", "staleness", "sync_every", "duration", "start", "length", "straggler")  # the sliders
MODE_COLORS = {"sync": "#4C72B0", "local_sgd": "#55A868", "ssp": "#DD8452", "async": "#C44E52"}


def shade(ax, window: Optional[tuple[float, float]]) -> None:
    if window:
        ax.axvspan(*window, color="#C44E52", alpha=0.12, label="partition")


def progress_figure(workers: dict[int, list[dict]], window=None, title: str = "") -> Figure:
    """Steps finished by each worker against wall-clock time, the partition shaded: a flat line is a
    worker that waits (availability lost), a line that keeps rising is one that carries on."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    shade(ax, window)
    for rank, records in sorted(workers.items()):
        ax.step([0.0] + [r["t_end"] for r in records], [0] + [r["step"] for r in records], where="post",
                lw=2, label=f"worker (rank {rank})")
    label_axes(ax, title or "Progress of each worker", "seconds since start", "steps finished")
    _ticks(ax)
    return fig


def divergence_figure(series: list[dict], window=None, updates: Optional[list[dict]] = None) -> Figure:
    """Left: replicas' distance to their average over time. Right: staleness of applied updates."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.6), dpi=100, layout="constrained")
    ax, ax_stale = fig.subplots(1, 2)
    shade(ax, window)
    ax.plot([p["t"] for p in series], [p["max"] for p in series], lw=2, label="max over replicas")
    ax.plot([p["t"] for p in series], [p["mean"] for p in series], lw=1.5, ls="--", label="mean over replicas")
    label_axes(ax, "Divergence between replicas", "seconds since start", "‖θ_r − θ̄‖₂")
    if updates:
        counts = measure.staleness_counts(updates)
        ax_stale.bar(list(counts), list(counts.values()), color="#8172B2")
        ax_stale.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_stale.yaxis.set_major_locator(MaxNLocator(integer=True))
        label_axes(ax_stale, f"Staleness of {len(updates)} updates", "clocks ahead of the slowest\n"
                   "worker at read", "updates", legend=False)
    else:
        ax_stale.text(0.5, 0.5, "no parameter server:\nevery update is applied\nby all replicas at once",
                      ha="center", va="center", fontsize=13, transform=ax_stale.transAxes)
        ax_stale.set_axis_off()
    _ticks(ax, ax_stale)
    return fig


def _ticks(*axes) -> None:
    for ax in axes:
        ax.tick_params(labelsize=12)


def mean_loss_curve(workers: dict[int, list[dict]], smooth: int = 10) -> tuple[list[float], list[float]]:
    """(times, smoothed loss) over every worker's steps in time order."""
    records = sorted((r for rs in workers.values() for r in rs), key=lambda r: r["t_end"])
    return [r["t_end"] for r in records], moving_average([r["loss"] for r in records], smooth)


def loss_by_step(workers: dict[int, list[dict]], smooth: int = 10) -> tuple[list[int], list[float]]:
    """(steps, smoothed loss averaged over the workers that reached each step)."""
    per_step: dict[int, list[float]] = {}
    for records in workers.values():
        for r in records:
            per_step.setdefault(r["step"], []).append(r["loss"])
    steps = sorted(per_step)
    return steps, moving_average([sum(per_step[k]) / len(per_step[k]) for k in steps], smooth)


def comparison_figure(runs: list[tuple[dict, dict[int, list[dict]]]]) -> Figure:
    """Top: loss against wall-clock time and against steps for each mode. Below: each run on availability
    (the others' computing share during the partition) against inconsistency (largest relative
    divergence), coloured by the final loss."""
    fig = Figure(figsize=(FIGURE_WIDTH, 8.8), dpi=100, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.15])
    ax_loss, ax_steps = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_trade = fig.add_subplot(grid[1, :])
    window = next((s.get("partition") for s, _ in runs if s.get("partition")), None)
    shade(ax_loss, window)
    for summary, workers in runs:
        mode = summary.get("consistency")
        ax_loss.plot(*mean_loss_curve(workers), lw=2, color=MODE_COLORS.get(mode), label=mode)
        ax_steps.plot(*loss_by_step(workers), lw=2, color=MODE_COLORS.get(mode), label=mode)
    label_axes(ax_loss, "Loss against time", "seconds since start", "training loss (smoothed)")
    label_axes(ax_steps, "Loss against steps", "step (per worker)", "", legend=False)
    rows = [r for r in comparison_rows([s for s, _ in runs]) if r["final_loss"] is not None]
    if rows:
        losses = [r["final_loss"] for r in rows]
        norm = Normalize(min(losses), max(losses) + 1e-9)
        for r in rows:
            x = r["others_busy_in_partition"] if r["others_busy_in_partition"] is not None else 0.0
            ax_trade.scatter(x, r["divergence_relative_max"], s=260, color=cm.viridis(norm(r["final_loss"])),
                             edgecolor="black", zorder=3)
            ax_trade.annotate(r["mode"], (x, r["divergence_relative_max"]), xytext=(10, 6),
                              textcoords="offset points", fontsize=13)
        bar = fig.colorbar(cm.ScalarMappable(norm=norm, cmap="viridis"), ax=ax_trade)
        bar.set_label("final validation loss", fontsize=12)
        bar.ax.tick_params(labelsize=12)
    label_axes(ax_trade, "The trade-off: availability vs consistency",
               "availability: share of the partition the others spent computing",
               "inconsistency:\nmax ‖θ_r − θ̄‖ / ‖θ̄‖", legend=False)
    _ticks(ax_loss, ax_steps, ax_trade)
    return fig


def comparison_text(rows: list[dict]) -> str:
    """:func:`labkit.consistency.report.comparison_rows` as a table narrow enough to print without wrapping."""
    def fmt(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    columns = (("mode", "", "mode", "s"), ("availability", "", "availability", "s"),
               ("consistency", "", "consistency", "s"),
               ("others busy", "in partition", "others_busy_in_partition", ".0%"),
               ("max diverg.", "(relative)", "divergence_relative_max", ".2%"),
               ("recovery", "(s)", "recovery_s", ".2f"), ("final loss", "", "final_loss", ".3f"))
    widths = [max(9, len(top), len(bottom)) for top, bottom, _, _ in columns]
    lines = ["  ".join(f"{col[row]:>{w}}" for col, w in zip(columns, widths)).rstrip() for row in (0, 1)]
    lines += ["  ".join(f"{fmt(r[key], spec):>{w}}" for (_, _, key, spec), w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def verdict_text(summary: dict) -> str:
    """:func:`labkit.consistency.report.verdict` as plain text, wrapped on word boundaries for printing."""
    return wrap(plain(verdict(summary)), indent="    ")


class CapLab:
    """Sliders for the consistency model and the faults; Run (one mode) and Compare all modes."""

    def __init__(self, config: Config, workers: int = 2, quick: Optional[bool] = None):
        quick = os.environ.get("LABKIT_QUICK") == "1" if quick is None else quick
        self.base = config
        style, layout = {"description_width": "200px"}, W.Layout(width="520px")
        c = config.comm
        duration = 2.5 if quick else (c.duration_s or 8.0)  # quick: the test run (8 runs in notebook 01)
        placed = c.partition_s > 0 and c.partition_start_s + c.partition_s < duration
        self.mode = W.Dropdown(options=list(MODES), value=c.consistency or "async", description="consistency",
                               style=style, layout=layout)
        self.workers = W.IntSlider(workers, min=2, max=3, description="workers", style=style, layout=layout)
        self.staleness = W.IntSlider(c.staleness, min=0, max=10, description="ssp: staleness bound s", style=style,
                                     layout=layout)
        self.sync_every = W.IntSlider(c.sync_every, min=1, max=64, description="local_sgd: sync every H",
                                      style=style, layout=layout)
        self.duration = W.FloatSlider(duration, min=2.0, max=30.0, step=0.5, description="run length (s)",
                                      style=style, layout=layout)
        self.start = W.FloatSlider(c.partition_start_s if placed else duration / 3, min=0.0, max=20.0, step=0.25,
                                   description="partition start (s)", style=style, layout=layout)
        self.length = W.FloatSlider(c.partition_s if placed else duration / 3, min=0.0, max=20.0, step=0.25,
                                    description="partition length (s)", style=style, layout=layout)
        self.straggler = W.FloatSlider(1.0, min=1.0, max=5.0, step=0.5, description="straggler: last worker ×",
                                       style=style, layout=layout)
        wide = W.Layout(width="auto")  # as wide as its label: never cut
        self.run_button = W.Button(description="Run", button_style="primary", icon="play", layout=wide)
        self.compare_button = W.Button(description="Compare all modes", icon="balance-scale", layout=wide)
        self.status = W.HTML()
        self.progress = Picture("each worker's progress appears here while a run trains")
        self.details = Picture("divergence and staleness appear here when a run ends")
        self.comparison = Picture("Compare all modes places each mode on availability against consistency here")
        self.run_button.on_click(lambda _: self._guarded(self.run))
        self.compare_button.on_click(lambda _: self._guarded(self.compare))
        self.summaries: list[dict] = []
        self.live = None  # the run in progress (or the last one)

    def settings(self, mode: Optional[str] = None, **overrides) -> dict:
        """What a run would use: the sliders' values (``SETTINGS``), with ``mode`` and ``overrides`` in their place.
        The sliders are left as they are: they keep showing what **Run** runs."""
        unknown = sorted(set(overrides) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}: choose from {', '.join(SETTINGS)}")
        chosen = {name: getattr(self, name).value for name in SETTINGS}
        chosen.update(overrides)
        chosen["mode"] = mode or chosen["mode"]
        return chosen

    def config(self, mode: Optional[str] = None, **overrides) -> Config:
        """The run's config from :meth:`settings`."""
        s = self.settings(mode, **overrides)
        last_worker = s["workers"] if s["mode"] in ("ssp", "async") else s["workers"] - 1  # rank 0: the server there
        return self.base.replace(**{
            "comm.consistency": s["mode"], "comm.staleness": s["staleness"], "comm.sync_every": s["sync_every"],
            "comm.duration_s": s["duration"], "run.steps": 1_000_000,
            "comm.partition_rank": 1 if s["length"] > 0 else None,
            "comm.partition_start_s": s["start"], "comm.partition_s": s["length"],
            "comm.slow_rank": last_worker if s["straggler"] > 1 else None,
            "comm.slow_factor": s["straggler"]})

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "inherit"
        self.status.value = f"<div style='font-size:1.15em;color:{color}'>{text}</div>"

    def _guarded(self, action, *args):
        """Button callbacks swallow exceptions: show them in the status line instead."""
        try:
            return action(*args)
        except Exception as error:  # noqa: BLE001 — reported to the user, not hidden
            self._say(f"<b>Failed:</b> {error}", error=True)

    def run(self, mode: Optional[str] = None, **overrides) -> dict:
        """Run one mode to the end, redrawing each worker's progress while it trains; returns its summary.
        ``overrides`` (any of ``SETTINGS``) replace the sliders' values for this run only."""
        import labkit

        workers = self.settings(mode, **overrides)["workers"]
        cfg = self.config(mode, **overrides)
        live = labkit.launch(cfg, nproc=processes_for(cfg.comm.consistency, workers))
        self._say(f"running <b>{cfg.comm.consistency}</b> with {workers} workers…")
        return self.follow(live, cfg)

    def follow(self, live, cfg: Config) -> dict:
        """Redraw ``live``'s progress (a run of ``cfg``, or a :func:`labkit.replay` of one) until it ends, then its
        divergence and verdict; returns its summary."""
        window = (cfg.comm.partition_start_s, cfg.comm.partition_start_s + cfg.comm.partition_s) \
            if cfg.comm.partition_s > 0 else None
        self.live = live
        try:
            while live.status == "running":
                workers = measure.load_progress(live.run_dir)
                if any(workers.values()):
                    self.progress.value = render_png(progress_figure(workers, window, f"{cfg.comm.consistency}: live"))
                time.sleep(0.5)
        except KeyboardInterrupt:  # the kernel was interrupted: end every worker, not just this loop
            live.stop()
            self._say(f"stopped {cfg.comm.consistency}: interrupted")
            raise
        live.wait()
        summary = {**(live.summary or {}), "run_dir": str(live.run_dir)}
        if summary.get("status") != "finished":
            raise RuntimeError(verdict(summary))
        workers, snaps, updates = measure.load(live.run_dir)
        self.progress.value = render_png(progress_figure(workers, window, f"{cfg.comm.consistency}: progress"))
        if snaps:  # a recording ships no replica snapshots (tens of MB): no divergence to draw
            series = measure.divergence_over_time(snaps, lockstep=cfg.comm.consistency in ("sync", "local_sgd"))
            self.details.value = render_png(divergence_figure(series, window, updates))
        self._say(verdict(summary))
        self.summaries.append(summary)
        return summary

    def replay(self, recorded) -> dict:
        """Follow a recorded consistency run (:func:`labkit.replay`) as :meth:`run` follows a live one."""
        return self.follow(recorded, from_dict(json.loads((recorded.run_dir / "config.json").read_text())))

    def compare(self, modes=MODES, **overrides) -> list[dict]:
        """Every mode under the same faults, side by side; the table is saved next to the runs."""
        summaries = [self.run(mode, **overrides) for mode in modes]
        runs = [(s, measure.load(s["run_dir"])[0]) for s in summaries]
        self.comparison.value = render_png(comparison_figure(runs))
        saved = Path(self.base.run.runs_dir) / f"cap-comparison-{time.strftime('%Y%m%d-%H%M%S')}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(comparison_rows(summaries), indent=2) + "\n")
        self._say("<br>".join(verdict(s) for s in summaries) + f"<br><small>saved {saved}</small>")
        return summaries

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>CAP trade-offs: consistency vs availability under a partition</h3>"),
                       self.mode, self.workers, self.staleness, self.sync_every, self.duration, self.start,
                       self.length, self.straggler, W.HBox([self.run_button, self.compare_button]), self.status,
                       self.progress, self.details, self.comparison])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
