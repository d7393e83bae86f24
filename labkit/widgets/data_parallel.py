"""The data-parallel lab: run several strategies on the same model and compare what they cost.

``compare_strategies`` launches one real run per strategy (one after another, so they do not
compete for the cores) and returns their summaries; the figures show step time split into
compute and exposed communication, bytes sent per step beside the analytic volume, each rank's
peak memory in forward, backward and the optimizer step beside the ZeRO paper's prediction of its
model states, and a timeline of one step with the all-reduces drawn over it.
"""
from __future__ import annotations

import json
from typing import Callable, Optional

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.config import Config, max_procs, resolve_device
from labkit.experiments import sweep
from labkit.memory_estimate import PRECISION_BYTES
from labkit.metrics.steps import PHASES
from labkit.parallel import STRATEGIES
from labkit.parallel.reports.data_parallel import analytic_wire_bytes, predict_rank_memory, strategy_summary
from labkit.plots import FIGURE_WIDTH, render_png

COLORS = {"compute": "#4C72B0", "exposed": "#C44E52", "data": "#8C8C8C", "params": "#4C72B0",
          "grads": "#DD8452", "optimizer": "#55A868", "fwd_bwd": "#4C72B0", "sync": "#DD8452",
          "optimizer_phase": "#55A868", "activations": "#8172B3", "data_phase": "#8C8C8C", "comm": "#C44E52",
          "peak_forward": "#8172B3", "peak_backward": "#C44E52", "peak_optimizer": "#937860"}
TIMELINE_LANES = (("data_phase", "data"), ("fwd_bwd", "forward + backward"), ("sync", "gradient sync"),
                  ("optimizer_phase", "optimizer"), ("comm", "collectives in flight (lower lane)"))


def phase_peaks(events: list[dict]) -> dict:
    """The tracked step's peak bytes per phase, one entry per rank (``Trainer.step``; None: no step tracked).

    ``{"peak_step": 1, "peak_forward_bytes": [rank 0, rank 1, ...], "peak_backward_bytes": ..., ...}`` from the
    last step event that carries them (one step per attempt is tracked: labkit.metrics.memory).
    """
    keys = [f"peak_{phase}_bytes" for phase in PHASES]
    tracked = [e for e in events if e.get("type") == "step"
               and any(v is not None for k in keys for v in e.get(f"rank_{k}") or [])]
    if not tracked:
        return {"peak_step": None, **dict.fromkeys(keys)}
    last = tracked[-1]
    return {"peak_step": last["step"], **{k: last.get(f"rank_{k}") for k in keys}}


def state_precision(mode: str) -> str:
    """The row of the ZeRO paper's bytes per parameter (``memory_estimate.PRECISION_BYTES``) that a labkit run's
    model states follow, for its ``precision.mode``: every mode keeps weights, gradients and Adam's moments in
    fp32 (``labkit.precision``: master weights; autocast lowers only the math), so "fp32" — 4 + 4 + 8 bytes.
    The paper's "mixed" row (fp16 weights and gradients, K = 12 for the fp32 copy and moments) is a trainer
    that stores fp16 weights, which labkit does not."""
    return "fp32"


def compare_strategies(config: Config, strategies: list[str], nproc: int,
                       on_progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """One real run per strategy, in turn; returns each run's :func:`strategy_summary`."""
    points = [(s, {"parallel.dp.strategy": s, "run.name": f"dp-{s}"}) for s in strategies]
    return sweep(config, nproc, points, lambda run, *_: strategy_row(run), on_progress)


def strategy_row(run) -> dict:
    """A finished run's row of the comparison (a live run or a :func:`labkit.replay` of one)."""
    events, config = run.events(), json.loads((run.run_dir / "config.json").read_text())
    precision = state_precision(config["precision"]["mode"])
    return {**strategy_summary(events), **phase_peaks(events), "state_precision": precision}


def comparison_figure(rows: list[dict]) -> Figure:
    """Top: step time split into compute and exposed communication, and bytes sent beside the ring formula.
    Below, across the width: memory per rank by phase beside ZeRO's model states (:func:`memory_panel`)."""
    fig = Figure(figsize=(FIGURE_WIDTH, 9.6), dpi=100, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.2])
    ax_time, ax_bytes = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_mem = fig.add_subplot(grid[1, :])
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    for i, r in enumerate(rows):  # step time: compute + exposed communication (+ data)
        if r["exposed_s"] is None:
            ax_time.bar(i, 1e3 * r["step_s"], color="#BBBBBB", hatch="//")
            ax_time.text(i, 1e3 * r["step_s"], "split\nn/a", ha="center", va="bottom", fontsize=12)
            continue
        bottom = 0.0
        for key, label in (("compute_s", "compute"), ("exposed_s", "exposed"), ("data_s", "data")):
            ax_time.bar(i, 1e3 * r[key], bottom=bottom, color=COLORS[label], label=label if i == 0 else None)
            bottom += 1e3 * r[key]
    ax_time.set_title("Step time (ms): compute\nvs exposed communication", fontsize=13)
    ax_time.legend(fontsize=11, ncol=2, loc="upper left")
    ax_bytes.bar(x, [r["comm_bytes"] / 1e6 for r in rows], color=COLORS["comm"], label="measured")
    ax_bytes.scatter(x, [analytic_wire_bytes(r["strategy"], r["params"], r["world_size"], r["grad_accum"]) / 1e6
                         for r in rows], marker="_", s=900, color="black", label="analytic (ring)", zorder=3)
    ax_bytes.set_title("MB sent per rank per step", fontsize=13)
    ax_bytes.legend(fontsize=11, ncol=1, loc="upper left")
    memory_panel(ax_mem, rows)
    for ax in (ax_time, ax_bytes, ax_mem):
        ax.set_xticks(list(x), names, rotation=30 if ax is not ax_mem else 0, ha="right" if ax is not ax_mem
                      else "center", rotation_mode="anchor", fontsize=12)
        ax.tick_params(axis="y", labelsize=12)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(top=ax.get_ylim()[1] * (1.5 if ax is ax_mem else 1.35))  # headroom: the legend sits above
    return fig


def memory_panel(ax, rows: list[dict]) -> None:
    """Per strategy: the ZeRO paper's model states for its stage (params + grads + optimizer state per rank,
    hatched), then the measured peak of forward, backward and the optimizer step — a bar for the largest
    rank, a dot per rank. A phase with no measurement (the step was not tracked; pipeline parallelism's
    forward, inside backward) gets no bar."""
    width, labelled = 0.2, set()

    def label(text: str):
        if text in labelled:
            return None
        labelled.add(text)
        return text

    for i, r in enumerate(rows):
        precision = r.get("state_precision", "fp32")
        split = predict_rank_memory(r["params"], r["world_size"], r["strategy"], precision)
        bottom = 0.0
        for value, part, per_param in zip((split.parameters, split.gradients, split.optimizer_state),
                                          ("params", "grads", "optimizer"), PRECISION_BYTES[precision]):
            ax.bar(i - 1.5 * width, value / 1e6, width, bottom=bottom, color=COLORS[part], alpha=0.55, hatch="//",
                   edgecolor="white", label=label(f"ZeRO: {part} ({per_param} B/param)"))
            bottom += value / 1e6
        for n, phase in enumerate(PHASES):
            ranks = [v / 1e6 for v in r.get(f"peak_{phase}_bytes") or [] if v is not None]
            if ranks:
                at = i + (n - 0.5) * width
                ax.bar(at, max(ranks), width, color=COLORS[f"peak_{phase}"], label=label(f"peak: {phase}"))
                ax.scatter([at] * len(ranks), ranks, s=12, color="black", zorder=3, label=label("each rank"))
    ax.set_title("Peak memory per rank (MB) by phase vs ZeRO's model states", fontsize=13)
    ax.legend(fontsize=11, ncol=3, loc="upper left")


def peak_table(rows: list[dict]) -> str:
    """The memory panel as text: ZeRO's predicted model states per rank, and each phase's measured peak (the
    largest rank's; n/a where the phase was not measured)."""
    def mb(values) -> str:
        values = [v for v in values or [] if v is not None]
        return f"{max(values) / 1e6:.2f}" if values else "n/a"

    lines = [f"{'strategy':13s} {'ZeRO states MB':>14s} " + " ".join(f"{phase + ' peak':>15s}" for phase in PHASES)]
    for r in rows:
        predicted = predict_rank_memory(r["params"], r["world_size"], r["strategy"], r.get("state_precision", "fp32"))
        lines.append(f"{r['strategy']:13s} {predicted.model_states / 1e6:14.2f} "
                     + " ".join(f"{mb(r.get(f'peak_{phase}_bytes')):>15s}" for phase in PHASES))
    return "\n".join(lines)


def timeline_figure(rows: list[dict]) -> Figure:
    """One step per strategy: compute phases on one lane, collectives in flight on the lane below."""
    fig = Figure(figsize=(FIGURE_WIDTH, 0.8 * len(rows) + 2.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        for phase, spans in r["timeline"].items():
            color = COLORS["comm"] if phase == "comm" else COLORS.get(f"{phase}_phase", COLORS.get(phase, "gray"))
            lane = y - 0.22 if phase == "comm" else y + 0.18
            ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in spans], (lane, 0.32), color=color,
                           alpha=0.75 if phase == "comm" else 1.0)
    ax.set_yticks(range(len(rows)), [r["strategy"] for r in reversed(rows)], fontsize=12)
    ax.tick_params(axis="x", labelsize=12)
    ax.set_xlabel("ms since the step started", fontsize=12)
    ax.set_title("One training step per strategy", fontsize=14)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(handles=[Patch(color=COLORS[key], label=label) for key, label in TIMELINE_LANES], fontsize=12,
               ncol=2, loc="outside lower center")
    return fig


class DataParallelLab:
    """Widgets: strategies, processes, bucket size, model size; Compare runs them all."""

    def __init__(self, config: Config):
        self.base = config
        self.rows: list[dict] = []
        style, layout = {"description_width": "120px"}, W.Layout(width="420px")
        self.strategies = W.SelectMultiple(options=list(STRATEGIES), value=tuple(STRATEGIES), rows=len(STRATEGIES),
                                           description="strategies", style=style, layout=layout)
        self.nproc = W.IntSlider(2, min=1, max=min(4, max(1, max_procs(resolve_device(config)))),
                                 description="processes", style=style, layout=layout)
        self.bucket_mb = W.FloatLogSlider(value=config.parallel.dp.bucket_mb, base=10, min=-3, max=2, step=0.25,
                                          description="bucket MB", style=style, layout=layout)
        self.n_embd = W.Dropdown(options=sorted({64, 128, 256, 320, config.model.n_embd}), value=config.model.n_embd,
                                 description="width",
                                 style=style, layout=layout)
        self.compare_button = W.Button(description="Compare", button_style="primary", icon="play",
                                       layout=W.Layout(width="auto"))
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
