"""The model-parallel lab's figures (``labkit.widgets.model_parallel`` runs the layouts and holds the panel).

Each figure reads the rows :mod:`labkit.parallel.reports.layout` computes from a run's events: the schedule a
pipeline really ran above the ideal grid, the bubble against the number of micro-batches beside the formula,
tensor parallelism's bytes per layer beside the analytic count, memory per rank beside the prediction, and the
step time split into its parts. Projector-sized: at most 9.5 inches wide at 100 dpi, text at 12 pt or more.
"""
from __future__ import annotations

from typing import Optional

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.parallel.reports.layout import SPLIT_PARTS
from labkit.parallel.pp.pipeline import SCHEDULES, ideal_bubble, ideal_schedule, peak_activations_in_flight
from labkit.plots import FIGURE_WIDTH, label_axes

COLORS = {"F": "#4C72B0", "B": "#DD8452", "idle": "#EEEEEE", "wait": "#CCCCCC", "compute": "#4C72B0",
          "data": "#8C8C8C", "dp_comm": "#C44E52", "model_comm": "#8172B3", "bubble": "#CCB974",
          "param": "#4C72B0", "grad": "#DD8452", "optimizer": "#55A868"}
PART_NAMES = {"compute": "compute", "data": "data", "dp_comm": "exposed dp comm", "model_comm": "tensor-parallel comm",
              "bubble": "pipeline bubble"}


def _grid_axes(ax, p: int) -> None:
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)], fontsize=12)
    ax.set_ylim(p - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=12)


def _cell(ax, x: float, width: float, stage: int, kind: str, mb: int, unit: float) -> None:
    ax.broken_barh([(x, width)], (stage - 0.4, 0.8), color=COLORS[kind], edgecolor="white", linewidth=0.8)
    if width >= 0.6 * unit:  # the label fits (a slot is wider than two characters at this size)
        ax.text(x + width / 2, stage, f"{kind}{mb}", ha="center", va="center", fontsize=12, color="white")


def _draw_ideal(ax, grid) -> None:
    """An ``ideal_schedule`` grid on ``ax``: one unit slot per forward or backward."""
    for stage, row in enumerate(grid):
        for slot, cell in enumerate(row):
            if cell is not None:
                _cell(ax, slot, 1, stage, cell[0], cell[1], 1)
    ax.set_xlim(0, len(grid[0]))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def schedule_figure(grid: Optional[list[list[dict]]], ideal_grid: list, title: str = "") -> Figure:
    """Top: the schedule as measured — one lane per stage, forwards (F) and backwards (B) where they ran, the
    wait for a neighbour's message in grey, idle white. Bottom: the ideal grid (one slot per F or B)."""
    p = len(ideal_grid)
    fig = Figure(figsize=(FIGURE_WIDTH, 1.6 + 1.3 * p), dpi=100, layout="constrained")
    ax_measured, ax_ideal = fig.subplots(2, 1)
    if grid:
        makespan = max(s["end"] for lane in grid for s in lane)
        unit = makespan / max(1, len(ideal_grid[0]))  # one ideal slot's share of the picture
        for stage, lane in enumerate(grid):
            for s in lane:
                start, end, wait = 1e3 * s["start"], 1e3 * s["end"], 1e3 * s["wait"]
                if wait > 0:
                    ax_measured.broken_barh([(start, wait)], (stage - 0.4, 0.8), color=COLORS["wait"])
                _cell(ax_measured, start + wait, end - start - wait, stage, s["kind"], s["mb"], 1e3 * unit)
        ax_measured.set_xlim(0, 1e3 * makespan)
        ax_measured.set_xlabel("ms since the first stage started", fontsize=12)
    else:
        ax_measured.text(0.5, 0.5, "no measured spans (parallel.pp.impl=torch runs its own loop)",
                         ha="center", va="center", fontsize=12, transform=ax_measured.transAxes)
    ax_measured.set_title(f"Measured{': ' + title if title else ''} (grey: waiting for a neighbour)", fontsize=13)
    _draw_ideal(ax_ideal, ideal_grid)
    ax_ideal.set_xlabel("slot (one forward or one backward each)", fontsize=12)
    ax_ideal.set_title("Ideal: ideal_schedule(p, m, schedule)", fontsize=13)
    for ax in (ax_measured, ax_ideal):
        _grid_axes(ax, p)
        ax.grid(axis="x", alpha=0.3)
    return fig


def ideal_schedules_figure(p: int, m: int) -> Figure:
    """GPipe and 1F1B on paper for p stages and m micro-batches (``ideal_schedule``): the same bubble,
    different order — and so different activations held."""
    fig = Figure(figsize=(FIGURE_WIDTH, 1.6 + 1.1 * p), dpi=100, layout="constrained")
    axes = fig.subplots(2, 1)
    for ax, schedule in zip(axes, SCHEDULES):
        _draw_ideal(ax, ideal_schedule(p, m, schedule))
        _grid_axes(ax, p)
        ax.grid(axis="x", alpha=0.3)
        held = [peak_activations_in_flight(p, m, schedule, s) for s in range(p)]
        ax.set_title(f"{schedule}: p = {p}, m = {m}; micro-batches held per stage {held}", fontsize=13)
    axes[-1].set_xlabel("slot (one forward or one backward each)", fontsize=12)
    return fig


def bubble_figure(rows: list[dict]) -> Figure:
    """The bubble against micro-batches per step m: (p − 1)/(m + p − 1) as a curve, each run's measured
    bubble (from the gathered timelines) and its stages' mean idle share as points."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, p in enumerate(sorted({r["p"] for r in rows})):
        mine = [r for r in rows if r["p"] == p]
        top = max(r["m"] for r in mine)
        ms = [1 + k * (top - 1) / 100 for k in range(101)]
        ax.plot(ms, [100 * ideal_bubble(p, m) for m in ms], color=f"C{i}", lw=2,
                label=f"(p − 1)/(m + p − 1), p = {p}")
        timed = [r for r in mine if r["bubble"] is not None]
        ax.plot([r["m"] for r in timed], [100 * r["bubble"] for r in timed], "o", ms=9, color=f"C{i}",
                label=f"measured: idle share of stages × makespan, p = {p}")
        timed = [r for r in mine if r["idle"] is not None]
        ax.plot([r["m"] for r in timed], [100 * r["idle"] for r in timed], "s", ms=7, mfc="none", color=f"C{i}",
                label=f"measured: mean of the stages' idle shares, p = {p}")
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sorted({r["m"] for r in rows}), [str(m) for m in sorted({r["m"] for r in rows})])
    ax.tick_params(labelsize=12)
    top = max([r["bubble"] or 0 for r in rows] + [r["idle"] or 0 for r in rows]
              + [ideal_bubble(r["p"], 1) for r in rows])
    ax.set_ylim(0, 150 * top)  # headroom for the legend
    label_axes(ax, "Pipeline bubble: more micro-batches, less idle", "micro-batches per step m", "bubble (% of time)",
               legend=False)
    ax.legend(fontsize=12)
    return fig


def _marks(ax, x, values, label: str, half: float = 0.3) -> None:
    """Predicted values as short black lines across the bars."""
    for i, (xi, v) in enumerate(zip(x, values)):
        ax.hlines(v, xi - half, xi + half, color="black", lw=3, zorder=3, label=label if i == 0 else None)


TP_PARTS = (("embedding", "embedding", "#64B5CD"), ("blocks", "blocks", "#DD8452"), ("head", "head", "#55A868"),
            ("loss", "loss", "#C44E52"), ("sequence_parallel_sync", "SP grad sync", "#937860"))


def tp_bytes_figure(rows: list[tuple[str, dict]]) -> Figure:
    """Left: tensor parallelism's bytes per layer per step (all micro-batches), measured on rank 0 beside
    ``tp_wire_bytes``. Right: the step's total, measured beside the analytic count stacked by part.
    One bar per run (:func:`labkit.parallel.reports.layout.tp_bytes_per_layer`)."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax_layer, ax_total = fig.subplots(1, 2)
    x = list(range(len(rows)))
    measured = [(r["measured_per_layer"] or 0) * r["micro_batches"] / 1e6 for _, r in rows]
    ax_layer.bar(x, measured, color=COLORS["model_comm"], width=0.6, label="measured")
    _marks(ax_layer, x, [r["analytic_per_layer"] * r["micro_batches"] / 1e6 for _, r in rows], "analytic")
    for i, (_, r) in enumerate(rows):
        if r["measured_per_layer"] is None:
            ax_layer.text(i, 0, "not\ncounted", ha="center", va="bottom", fontsize=12)
    width = 0.35
    ax_total.bar([i - width / 2 for i in x], [(r["measured_total"] or 0) / 1e6 for _, r in rows], width=width,
                 color=COLORS["model_comm"], label="measured")
    bottom = [0.0] * len(rows)
    for key, name, color in TP_PARTS:
        values = [r["analytic_parts"][key] * (1 if key == "sequence_parallel_sync" else r["micro_batches"]) / 1e6
                  for _, r in rows]
        if not any(values):
            continue
        ax_total.bar([i + width / 2 for i in x], values, bottom=bottom, width=width, color=color,
                     label=f"analytic: {name}")
        bottom = [b + v for b, v in zip(bottom, values)]
    for ax, title, ylabel in ((ax_layer, "Per layer", "MB per layer per step"),
                              (ax_total, "Whole step", "MB per step")):
        ax.set_xticks(x, [label for label, _ in rows], fontsize=12)
        ax.tick_params(labelsize=12)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.45)
        label_axes(ax, title, "", ylabel, legend=False)
    ax_layer.legend(fontsize=12, loc="upper left")
    ax_total.legend(fontsize=12, loc="upper left", ncol=1, bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Tensor parallelism: MB rank 0 sends", fontsize=14)
    return fig


def _legend_once():
    """A function that gives each legend entry to its first bar only (None after that)."""
    named = set()

    def once(name: str) -> Optional[str]:
        if name in named:
            return None
        named.add(name)
        return name

    return once


def _per_rank_groups(ax, groups: list[tuple[str, list[dict]]], draw, tick, label_y: float = -0.1) -> None:
    """One group of bars per run (``(label, rows)``), one bar per rank: ``draw(x, row)`` draws a rank's bar at
    ``x``, ``tick(row)`` labels it; each run's label under its group, a gap between groups."""
    x, ticks, labels = 0, [], []
    for label, rows in groups:
        for r in rows:
            draw(x, r)
            ticks.append(x)
            labels.append(tick(r))
            x += 1
        ax.text((x - 1 + x - len(rows)) / 2, label_y, label, ha="center", va="top", fontsize=12,
                transform=ax.get_xaxis_transform())
        x += 1  # a gap between runs
    ax.set_xticks(ticks, labels, fontsize=12)
    ax.tick_params(labelsize=12)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)


STATE_NAMES = {"param": "parameters", "grad": "gradients", "optimizer": "optimizer state"}


def memory_figure(runs: list[tuple[str, list[dict]]]) -> Figure:
    """Model-state bytes per rank, measured (stacked: parameters, gradients, optimizer state) beside the
    prediction for the layout (black marks), one group of bars per run."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    once = _legend_once()

    def draw(x: int, r: dict) -> None:
        bottom = 0.0
        for key in ("param", "grad", "optimizer"):
            value = r["measured"][key] / 1e6
            ax.bar(x, value, bottom=bottom, color=COLORS[key], width=0.8, label=once(STATE_NAMES[key]))
            bottom += value
        _marks(ax, [x], [r["predicted_total"] / 1e6], once("predicted (reports.layout)"), 0.4)

    _per_rank_groups(ax, runs, draw, lambda r: f"r{r['rank']}")
    label_axes(ax, "Model states per rank: measured vs predicted", "", "MB", legend=False)
    ax.legend(fontsize=12, ncol=2, loc="upper left")
    return fig


def activation_figure(reports: list[tuple[str, dict]]) -> Figure:
    """Each rank's peak activations — one micro-batch's saved tensors times the micro-batches it held at once —
    measured (bars, hatched where the run did not count them) beside the prediction for its stage (black marks), one
    group of bars per run (:func:`labkit.parallel.reports.activation_memory.activation_memory`)."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    once = _legend_once()

    def draw(x: int, r: dict) -> None:
        if r["measured_peak"] is None:
            ax.bar(x, (r["predicted_peak"] or 0.0) / 1e6, color="none", edgecolor="#8C8C8C", hatch="//",
                   width=0.8, label=once("not counted by the run"))
        else:
            ax.bar(x, r["measured_peak"] / 1e6, color=COLORS["F"], width=0.8, label=once("measured"))
        if r["predicted_peak"] is not None:
            _marks(ax, [x], [r["predicted_peak"] / 1e6], once("predicted (activation_memory)"), 0.4)

    _per_rank_groups(ax, [(label, report["rows"]) for label, report in reports], draw,
                     lambda r: f"r{r['rank']}\n×{r['held'] if r['held'] is not None else '?'}", label_y=-0.2)
    label_axes(ax, "Peak activations per rank (× micro-batches held): measured vs predicted", "", "MB", legend=False)
    ax.legend(fontsize=12, loc="upper left")
    return fig


def step_split_figure(splits: list[tuple[str, dict]]) -> Figure:
    """Each run's mean step time split into compute, data, exposed dp communication, tensor-parallel communication and
    bubble (:func:`labkit.parallel.reports.layout.step_split`), as horizontal stacked bars."""
    fig = Figure(figsize=(FIGURE_WIDTH, 2.6 + 0.75 * len(splits)), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, (label, s) in enumerate(splits):
        y = len(splits) - 1 - i
        if s["compute"] is None:
            ax.barh(y, 1e3 * s["step"], color="#BBBBBB", hatch="//")
            ax.text(1e3 * s["step"], y, "  split n/a", va="center", fontsize=12)
            continue
        left = 0.0
        for part in SPLIT_PARTS:
            ax.barh(y, 1e3 * s[part], left=left, color=COLORS[part], label=PART_NAMES[part] if i == 0 else None)
            left += 1e3 * s[part]
    ax.set_yticks(range(len(splits)), [label for label, _ in reversed(splits)], fontsize=12)
    ax.tick_params(axis="x", labelsize=12)
    ax.set_xlabel("ms per step (rank 0, steady-state mean)", fontsize=12)
    ax.set_title("Where a step's time goes", fontsize=14)
    ax.grid(axis="x", alpha=0.3)
    if any(s["compute"] is not None for _, s in splits):
        fig.legend(fontsize=12, ncol=3, loc="outside lower center")
    return fig
