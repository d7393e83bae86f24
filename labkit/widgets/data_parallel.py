"""The data-parallel lab: run several strategies on the same model and compare what they cost.

``compare_strategies`` launches one real run per strategy (one after another, so they do not
compete for the cores) and returns their summaries; the figures show step time split into
compute and exposed communication, bytes sent per step beside the analytic volume, memory per
rank beside the ZeRO prediction, and a timeline of one step with the all-reduces drawn over it.
"""
from __future__ import annotations

from typing import Callable, Optional

import ipywidgets as W
from matplotlib.figure import Figure

from labkit.config import Config, max_procs, resolve_device
from labkit.experiments import sweep
from labkit.parallel import STRATEGIES
from labkit.parallel.report import analytic_wire_bytes, predict_rank_memory, strategy_summary
from labkit.plots import render_png

COLORS = {"compute": "#4C72B0", "exposed": "#C44E52", "data": "#8C8C8C", "params": "#4C72B0",
          "grads": "#DD8452", "optimizer": "#55A868", "fwd_bwd": "#4C72B0", "sync": "#DD8452",
          "optimizer_phase": "#55A868", "activations": "#8172B3", "data_phase": "#8C8C8C", "comm": "#C44E52"}


def compare_strategies(config: Config, strategies: list[str], nproc: int,
                       on_progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """One real run per strategy, in turn; returns each run's :func:`strategy_summary`."""
    points = [(s, {"parallel.dp.strategy": s, "run.name": f"dp-{s}"}) for s in strategies]
    return sweep(config, nproc, points, lambda run, *_: strategy_summary(run.events()), on_progress)


def comparison_figure(rows: list[dict]) -> Figure:
    fig = Figure(figsize=(14, 4.8), dpi=100, layout="constrained")
    ax_time, ax_bytes, ax_mem = fig.subplots(1, 3)
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    for i, r in enumerate(rows):  # step time: compute + exposed communication (+ data)
        if r["exposed_s"] is None:
            ax_time.bar(i, 1e3 * r["step_s"], color="#BBBBBB", hatch="//")
            ax_time.text(i, 1e3 * r["step_s"], "split n/a", ha="center", va="bottom", fontsize=10)
            continue
        bottom = 0.0
        for key, label in (("compute_s", "compute"), ("exposed_s", "exposed"), ("data_s", "data")):
            ax_time.bar(i, 1e3 * r[key], bottom=bottom, color=COLORS[label], label=label if i == 0 else None)
            bottom += 1e3 * r[key]
    ax_time.set_title("Step time (ms): compute vs exposed communication", fontsize=13)
    ax_time.legend(fontsize=11, ncol=3, loc="upper left")
    ax_bytes.bar(x, [r["comm_bytes"] / 1e6 for r in rows], color=COLORS["comm"], label="measured")
    ax_bytes.scatter(x, [analytic_wire_bytes(r["strategy"], r["params"], r["world_size"], r["grad_accum"]) / 1e6
                         for r in rows], marker="_", s=900, color="black", label="analytic (ring)", zorder=3)
    ax_bytes.set_title("MB sent per rank per step", fontsize=13)
    ax_bytes.legend(fontsize=11, ncol=2, loc="upper left")
    bottom = [0.0] * len(rows)
    for key, label in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer"),
                       ("activation_bytes", "activations")):
        values = [(r.get(key) or 0) / 1e6 for r in rows]
        ax_mem.bar(x, values, bottom=bottom, color=COLORS[label], label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    predicted = [predict_rank_memory(r["params"], r["world_size"], r["strategy"]).model_states / 1e6 for r in rows]
    ax_mem.scatter(x, predicted, marker="_", s=900, color="black", label="ZeRO prediction (model states)",
                   zorder=3)
    ax_mem.set_title("Memory per rank (MB): model states + activations", fontsize=13)
    ax_mem.legend(fontsize=11, ncol=2, loc="upper left")
    for ax in (ax_time, ax_bytes, ax_mem):
        ax.set_xticks(list(x), names, rotation=20, fontsize=11)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # headroom: the legend sits above the bars
    return fig


def timeline_figure(rows: list[dict]) -> Figure:
    """One step per strategy: compute phases on one lane, collectives in flight on the lane below."""
    fig = Figure(figsize=(14, 0.9 * len(rows) + 1.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        for phase, spans in r["timeline"].items():
            color = COLORS["comm"] if phase == "comm" else COLORS.get(f"{phase}_phase", COLORS.get(phase, "gray"))
            lane = y - 0.22 if phase == "comm" else y + 0.18
            ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in spans], (lane, 0.32), color=color,
                           alpha=0.75 if phase == "comm" else 1.0)
    ax.set_yticks(range(len(rows)), [r["strategy"] for r in reversed(rows)], fontsize=12)
    ax.set_xlabel("ms since the step started", fontsize=12)
    ax.set_title("One training step: forward+backward (blue), gradient sync (orange), optimizer (green); "
                 "collectives in flight (red, lower lane)", fontsize=12)
    ax.grid(axis="x", alpha=0.3)
    return fig


class DataParallelLab:
    """Widgets: strategies, processes, bucket size, model size; Compare runs them all."""

    def __init__(self, config: Config):
        self.base = config
        self.rows: list[dict] = []
        style, layout = {"description_width": "120px"}, W.Layout(width="420px")
        self.strategies = W.SelectMultiple(options=list(STRATEGIES), value=tuple(STRATEGIES), rows=6,
                                           description="strategies", style=style, layout=layout)
        self.nproc = W.IntSlider(2, min=1, max=min(4, max(1, max_procs(resolve_device(config)))),
                                 description="processes", style=style, layout=layout)
        self.bucket_mb = W.FloatLogSlider(value=config.parallel.dp.bucket_mb, base=10, min=-3, max=2, step=0.25,
                                          description="bucket MB", style=style, layout=layout)
        self.n_embd = W.Dropdown(options=sorted({64, 128, 256, 320, config.model.n_embd}), value=config.model.n_embd,
                                 description="width",
                                 style=style, layout=layout)
        self.compare_button = W.Button(description="Compare", button_style="primary", icon="play")
        self.status = W.HTML()
        self.figures = W.VBox()
        self.compare_button.on_click(lambda _: self.run())

    def config(self) -> Config:
        return self.base.replace(**{"parallel.dp.bucket_mb": self.bucket_mb.value, "model.n_embd": self.n_embd.value})

    def _say(self, text: str) -> None:
        self.status.value = f"<div style='font-size:1.15em'>{text}</div>"

    def run(self) -> list[dict]:
        self.compare_button.disabled = True
        try:
            self.rows = compare_strategies(self.config(), list(self.strategies.value), self.nproc.value, self._say)
        except Exception as error:
            self._say(f"<span style='color:#b00020'><b>Failed:</b> {error}</span>")
            raise
        finally:
            self.compare_button.disabled = False
        self.figures.children = [W.Image(value=render_png(comparison_figure(self.rows)), format="png"),
                                 W.Image(value=render_png(timeline_figure(self.rows)), format="png")]
        return self.rows

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Data-parallel strategies</h3>"), self.strategies, self.nproc, self.bucket_mb,
                       self.n_embd, self.compare_button, self.status, self.figures])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
