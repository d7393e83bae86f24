"""The CAP lab: choose a consistency model, cut a worker off, and watch availability and consistency trade.

``CapLab`` starts a live run of 2–4 workers (plus a parameter server for ``ssp`` / ``async``) with
the partition and straggler set by its sliders, draws each worker's progress while it runs, and
afterwards the divergence between replicas and the staleness of updates. **Compare all modes**
runs the four models under the same partition and places each on availability against
consistency, with the final loss as colour. The figures are pure functions of a run's logs
(:mod:`labkit.consistency.measure`), tested without a kernel.
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

from labkit.config import Config
from labkit.consistency import measure, processes_for
from labkit.consistency.report import comparison_rows, verdict
from labkit.plots import label_axes, moving_average, render_png

MODES = ("sync", "local_sgd", "ssp", "async")
MODE_COLORS = {"sync": "#4C72B0", "local_sgd": "#55A868", "ssp": "#DD8452", "async": "#C44E52"}


def shade(ax, window: Optional[tuple[float, float]]) -> None:
    if window:
        ax.axvspan(*window, color="#C44E52", alpha=0.12, label="partition")


def progress_figure(workers: dict[int, list[dict]], window=None, title: str = "") -> Figure:
    """Steps finished by each worker against wall-clock time, the partition shaded: a flat line is a
    worker that waits (availability lost), a line that keeps rising is one that carries on."""
    fig = Figure(figsize=(9, 4.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    shade(ax, window)
    for rank, records in sorted(workers.items()):
        ax.step([0.0] + [r["t_end"] for r in records], [0] + [r["step"] for r in records], where="post",
                lw=2, label=f"worker (rank {rank})")
    label_axes(ax, title or "Progress of each worker", "seconds since start", "steps finished")
    return fig


def divergence_figure(series: list[dict], window=None, updates: Optional[list[dict]] = None) -> Figure:
    """Left: replicas' distance to their average over time. Right: staleness of applied updates."""
    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    ax, ax_stale = fig.subplots(1, 2)
    shade(ax, window)
    ax.plot([p["t"] for p in series], [p["max"] for p in series], lw=2, label="max over replicas")
    ax.plot([p["t"] for p in series], [p["mean"] for p in series], lw=1.5, ls="--", label="mean over replicas")
    label_axes(ax, "Divergence between replicas", "seconds since start", "‖θ_r − θ̄‖₂")
    if updates:
        counts = measure.staleness_counts(updates)
        ax_stale.bar(list(counts), list(counts.values()), color="#8172B2")
        label_axes(ax_stale, f"Staleness of {len(updates)} applied updates", "clocks ahead of the slowest "
                   "worker at read", "updates", legend=False)
    else:
        ax_stale.text(0.5, 0.5, "no parameter server:\nevery update is applied\nby all replicas at once",
                      ha="center", va="center", fontsize=13, transform=ax_stale.transAxes)
        ax_stale.set_axis_off()
    return fig


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
    """Loss against wall-clock time and against steps for each mode; then each run on availability
    (the others' computing share during the partition) against inconsistency (largest relative
    divergence), coloured by the final loss."""
    fig = Figure(figsize=(18, 4.8), dpi=100, layout="constrained")
    ax_loss, ax_steps, ax_trade = fig.subplots(1, 3)
    window = next((s.get("partition") for s, _ in runs if s.get("partition")), None)
    shade(ax_loss, window)
    for summary, workers in runs:
        mode = summary.get("consistency")
        ax_loss.plot(*mean_loss_curve(workers), lw=2, color=MODE_COLORS.get(mode), label=mode)
        ax_steps.plot(*loss_by_step(workers), lw=2, color=MODE_COLORS.get(mode), label=mode)
    label_axes(ax_loss, "Loss against wall-clock time", "seconds since start", "training loss (smoothed)")
    label_axes(ax_steps, "Loss against steps", "step (per worker)", "training loss (smoothed)")
    rows = [r for r in comparison_rows([s for s, _ in runs]) if r["final_loss"] is not None]
    if rows:
        losses = [r["final_loss"] for r in rows]
        norm = Normalize(min(losses), max(losses) + 1e-9)
        for r in rows:
            x = r["others_busy_in_partition"] if r["others_busy_in_partition"] is not None else 0.0
            ax_trade.scatter(x, r["divergence_relative_max"], s=260, color=cm.viridis(norm(r["final_loss"])),
                             edgecolor="black", zorder=3)
            ax_trade.annotate(r["mode"], (x, r["divergence_relative_max"]), xytext=(10, 6),
                              textcoords="offset points", fontsize=12)
        fig.colorbar(cm.ScalarMappable(norm=norm, cmap="viridis"), ax=ax_trade, label="final validation loss")
    label_axes(ax_trade, "The trade-off: availability vs consistency",
               "availability: share of the partition the others spent computing", "inconsistency: max ‖θ_r − θ̄‖ / ‖θ̄‖",
               legend=False)
    return fig


class CapLab:
    """Sliders for the consistency model and the faults; Run (one mode) and Compare all modes."""

    def __init__(self, config: Config, workers: int = 2, quick: Optional[bool] = None):
        quick = os.environ.get("LABKIT_QUICK") == "1" if quick is None else quick
        self.base = config
        style, layout = {"description_width": "170px"}, W.Layout(width="480px")
        c = config.comm
        duration = 3.0 if quick else (c.duration_s or 8.0)
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
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.compare_button = W.Button(description="Compare all modes", icon="balance-scale")
        self.status = W.HTML()
        self.progress = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.details = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.comparison = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.run_button.on_click(lambda _: self._guarded(self.run))
        self.compare_button.on_click(lambda _: self._guarded(self.compare))
        self.summaries: list[dict] = []
        self.live = None  # the run in progress (or the last one)

    def config(self, mode: Optional[str] = None) -> Config:
        mode = mode or self.mode.value
        n = self.workers.value
        last_worker = n if mode in ("ssp", "async") else n - 1  # rank 0 is the server in those modes
        return self.base.replace(**{
            "comm.consistency": mode, "comm.staleness": self.staleness.value, "comm.sync_every": self.sync_every.value,
            "comm.duration_s": self.duration.value, "run.steps": 1_000_000,
            "comm.partition_rank": 1 if self.length.value > 0 else None,
            "comm.partition_start_s": self.start.value, "comm.partition_s": self.length.value,
            "comm.slow_rank": last_worker if self.straggler.value > 1 else None,
            "comm.slow_factor": self.straggler.value})

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "inherit"
        self.status.value = f"<div style='font-size:1.15em;color:{color}'>{text}</div>"

    def _guarded(self, action, *args):
        """Button callbacks swallow exceptions: show them in the status line instead."""
        try:
            return action(*args)
        except Exception as error:  # noqa: BLE001 — reported to the user, not hidden
            self._say(f"<b>Failed:</b> {error}", error=True)

    def run(self, mode: Optional[str] = None) -> dict:
        """Run one mode to the end, redrawing each worker's progress while it trains; returns its summary."""
        import labkit

        cfg = self.config(mode)
        live = labkit.launch(cfg, nproc=processes_for(cfg.comm.consistency, self.workers.value))
        self._say(f"running <b>{cfg.comm.consistency}</b> with {self.workers.value} workers…")
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
        series = measure.divergence_over_time(snaps, lockstep=cfg.comm.consistency in ("sync", "local_sgd"))
        self.progress.value = render_png(progress_figure(workers, window, f"{cfg.comm.consistency}: progress"))
        self.details.value = render_png(divergence_figure(series, window, updates))
        self._say(verdict(summary))
        self.summaries.append(summary)
        return summary

    def compare(self, modes=MODES) -> list[dict]:
        """Every mode under the same faults, side by side; the table is saved next to the runs."""
        summaries = [self.run(mode) for mode in modes]
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
