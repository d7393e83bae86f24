"""The optimisation advisor, drawn: the flowchart with the walk on it, the table of tries, a Start button.

The loop itself is :func:`labkit.tuning.runner.optimize`; everything here is a view of its
:class:`~labkit.tuning.flowchart.Decision` log. The figures and the table are pure functions of that log,
so they are tested without a kernel, and the panel only wires sliders to ``optimize``'s arguments.
"""
from __future__ import annotations

import html

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from labkit.config import Config
from labkit.plots import OUTPUT_WIDTH_PX, label_axes, render_png
from labkit.tuning.flowchart import (
    COMMUNICATION_BOUND,
    COMPUTE_BOUND,
    KERNELS_AND_COMPILE,
    UTILIZATION_OK,
    Decision,
    Thresholds,
)
from labkit.tuning.runner import MEASURE, RECORD_BEST, OptimizationResult, optimize
from labkit.widgets.picture import Picture

UTILIZATION_CHECK = "utilization_check"
"""The flowchart's diamond: is the device busy enough? Visited whenever the baseline is classified."""

LAYOUT = {  # node → (label, x, y) in axes fractions; drawn top to bottom as the walk goes
    MEASURE: ("Measure\ntokens/s · MFU · exposed comm", 0.5, 0.91),
    UTILIZATION_CHECK: ("MFU ≥ {utilization:.0%}?", 0.5, 0.72),
    COMMUNICATION_BOUND: ("Communication-bound\n(exposed comm > {comm_frac:.0%})\ncompress gradients,\nsync less often",
                          0.16, 0.49),
    COMPUTE_BOUND: ("Compute-bound\nmixed precision,\nmodel shape", 0.5, 0.49),
    UTILIZATION_OK: ("Utilisation OK\ngrow batch &\nparallelism", 0.84, 0.49),
    KERNELS_AND_COMPILE: ("Attention kernels\n& compilation", 0.5, 0.27),
    RECORD_BEST: ("Record the best config", 0.5, 0.08),
}
EDGES = [(MEASURE, UTILIZATION_CHECK), (UTILIZATION_CHECK, COMMUNICATION_BOUND), (UTILIZATION_CHECK, COMPUTE_BOUND),
         (UTILIZATION_CHECK, UTILIZATION_OK), (COMMUNICATION_BOUND, KERNELS_AND_COMPILE),
         (COMPUTE_BOUND, KERNELS_AND_COMPILE), (UTILIZATION_OK, KERNELS_AND_COMPILE),
         (KERNELS_AND_COMPILE, RECORD_BEST)]
CURRENT_COLOR, VISITED_COLOR, IDLE_COLOR = "#F2A541", "#B7D3EA", "#FFFFFF"
KEPT_COLOR, REJECTED_COLOR, BASELINE_COLOR = "#2E8B57", "#C44E52", "#7F7F7F"


def visited_nodes(decisions: list[Decision]) -> list[str]:
    """The nodes a decision log passed through, in order (the diamond right after measuring)."""
    out: list[str] = []
    for d in decisions:
        for node in (d.node, UTILIZATION_CHECK) if d.node == MEASURE else (d.node,):
            if node not in out:
                out.append(node)
    return out


def node_colors(current_node: str | None, visited) -> dict[str, str]:
    """Fill colour of every box: the current node highlighted, visited ones shaded, the rest white."""
    unknown = {current_node, *visited} - set(LAYOUT) - {None}
    if unknown:
        raise ValueError(f"unknown flowchart node(s) {sorted(unknown)}; nodes are {', '.join(LAYOUT)}")
    return {node: CURRENT_COLOR if node == current_node else VISITED_COLOR if node in visited else IDLE_COLOR
            for node in LAYOUT}


def flowchart_figure(current_node: str | None, visited=(), thresholds: Thresholds | None = None) -> Figure:
    """The source text's optimisation flowchart; ``fig.node_patches`` maps each node to its box."""
    t = thresholds or Thresholds()
    colors = node_colors(current_node, set(visited))
    fig = Figure(figsize=(12, 7), dpi=100)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    for a, b in EDGES:
        (_, xa, ya), (_, xb, yb) = LAYOUT[a], LAYOUT[b]
        ax.add_patch(FancyArrowPatch((xa, ya - 0.06), (xb, yb + 0.07), arrowstyle="-|>", mutation_scale=22,
                                     lw=1.8, color="#555555"))
    for sign, x in (("<", 0.29), ("≥", 0.71)):
        ax.text(x, 0.63, f"{sign} {t.utilization:.0%}", fontsize=13, ha="center", color="#555555")
    fig.node_patches = {}
    for node, (label, x, y) in LAYOUT.items():
        text = label.format(utilization=t.utilization, comm_frac=t.comm_frac)
        style = "round,pad=0.02" if node != UTILIZATION_CHECK else "sawtooth,pad=0.02"
        width = 0.27 if node in (COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK) else 0.34
        height = 0.15 if node in (COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK) else 0.09
        box = FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle=style, lw=3 if
                             node == current_node else 1.5, edgecolor="#333333", facecolor=colors[node])
        ax.add_patch(box)
        fig.node_patches[node] = box
        ax.text(x, y, text, ha="center", va="center", fontsize=14,
                fontweight="bold" if node == current_node else "normal")
    return fig


# ---------------------------------------------------------------- the tries

def _change(d: Decision) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.candidate.overrides.items()) if d.candidate else "—"


def decision_line(d: Decision) -> str:
    """One line per decision, for a log: ``3 · communication_bound · comm.compression=bf16 · kept: ...``."""
    return f"{d.iteration} · {d.node} · {_change(d)} · {d.reason}"


def verdict(d: Decision) -> str:
    """``kept``, ``rejected`` (measured, not good enough) or ``skipped`` (never run); ``—`` for notes."""
    if d.candidate is None:
        return "—"
    if d.kept:
        return "kept"
    return "rejected" if d.trial is not None or d.reason.startswith("rejected") else "skipped"


TABLE_HEAD = ["#", "node", "change", "tokens/s before → after", "loss", "verdict", "reason"]
CELL = "padding:3px 8px;text-align:left;vertical-align:top"
NOWRAP = CELL + ";white-space:nowrap"  # a number or a name is never broken; only the reason (prose) wraps


def trials_table_html(decisions: list[Decision]) -> str:
    """One row per decision: the change, throughput before → after, loss, verdict and reason."""
    rows = []
    for d in decisions:
        rate = f"{d.baseline.tokens_per_s:,.0f}" + (f" → {d.trial.tokens_per_s:,.0f}" if d.trial else "")
        loss = "" if d.trial is None or d.trial.loss is None else f"{d.trial.loss:.3f}"
        color = {"kept": KEPT_COLOR, "rejected": REJECTED_COLOR}.get(verdict(d), "#555555")
        cells = [str(d.iteration), d.node.replace("_", " "), html.escape(_change(d)), rate, loss,
                 f"<b style='color:{color}'>{verdict(d)}</b>"]
        rows.append("<tr>" + "".join(f"<td style='{NOWRAP}'>{c}</td>" for c in cells)
                    + f"<td style='{CELL};min-width:16em'>{html.escape(d.reason)}</td></tr>")
    header = "".join(f"<th style='{NOWRAP}'>{h}</th>" for h in TABLE_HEAD)
    return (f"<div style='max-width:100%;overflow-x:auto'>"
            f"<table style='border-collapse:collapse;table-layout:auto;margin:0'>"
            f"<tr>{header}</tr>{''.join(rows)}</table></div>")


def trials_figure(decisions: list[Decision]) -> Figure:
    """Throughput and final loss of the baseline and every measured try; kept green, rejected red."""
    measured = [d for d in decisions if d.trial is not None]
    first = next((d.baseline for d in decisions if d.node == MEASURE), measured[0].baseline if measured else None)
    points = ([first] if first else []) + [d.trial for d in measured]
    labels = (["baseline"] if first else []) + [f"{d.iteration}. {d.candidate.feature}" for d in measured]
    colors = ([BASELINE_COLOR] if first else []) + [KEPT_COLOR if d.kept else REJECTED_COLOR for d in measured]
    fig = Figure(figsize=(OUTPUT_WIDTH_PX / 100, 1.6 + 0.55 * max(len(points), 2)), dpi=100, layout="constrained")
    ax_rate, ax_loss = fig.subplots(1, 2, sharey=True)
    y = list(range(len(points)))[::-1]  # first try on top
    ax_rate.barh(y, [m.tokens_per_s for m in points], color=colors)
    ax_loss.barh(y, [m.loss or 0.0 for m in points], color=colors)
    ax_rate.set_yticks(y, labels, fontsize=12)
    if first:
        ax_rate.axvline(first.tokens_per_s, ls="--", color=BASELINE_COLOR)
    losses = [m.loss for m in points if m.loss is not None]
    if losses:
        ax_loss.set_xlim(0.9 * min(losses), 1.05 * max(losses))
    legend = [Patch(color=c, label=t) for c, t in ((BASELINE_COLOR, "baseline"), (KEPT_COLOR, "kept"),
                                                    (REJECTED_COLOR, "rejected"))]
    label_axes(ax_rate, "Throughput per try", "tokens/s", "", legend=False)
    label_axes(ax_loss, "Final loss per try", "loss (nats/token)", "", legend=False)
    ax_loss.legend(handles=legend, fontsize=11, loc="lower right")
    return fig


# ---------------------------------------------------------------- the panel

class AdvisorLab:
    """Sliders for the thresholds and budgets, a Start button, and the walk drawn as it happens.

    ``optimize_kwargs`` go to :func:`~labkit.tuning.runner.optimize` (``repeats``, ``steps``, ``out_yaml``, ...).
    The walk runs in the button's callback: the kernel is busy meanwhile, but each decision is pushed to
    the widgets at once, so the flowchart moves live.
    """

    def __init__(self, config: Config, nproc: int = 2, **optimize_kwargs):
        style, layout = {"description_width": "190px"}, W.Layout(width="480px")
        self.config, self.nproc, self.optimize_kwargs = config, nproc, optimize_kwargs
        self.decisions: list[Decision] = []
        self.result: OptimizationResult | None = None
        self.utilization = W.IntSlider(70, min=5, max=100, step=5, description="utilisation threshold (%)",
                                       style=style, layout=layout)
        self.comm_frac = W.IntSlider(round(100 * Thresholds().comm_frac), min=5, max=95, step=5,
                                     description="exposed comm threshold (%)",
                                     style=style, layout=layout)
        self.max_trials = W.IntSlider(4, min=1, max=12, description="max trials", style=style, layout=layout)
        self.time_budget = W.IntSlider(300, min=30, max=1800, step=30, description="time budget (s)", style=style,
                                       layout=layout)
        self.start_button = W.Button(description="Start", button_style="success", icon="play")
        self.status = W.HTML(self._line("set the thresholds and budgets, then Start"))
        self.flowchart = Picture(waiting="the flowchart appears with the first decision: press Start")
        self.table = W.HTML()
        self.start_button.on_click(lambda _: self.start())

    @staticmethod
    def _line(text: str, color: str = "#222222") -> str:
        return f"<div style='font-size:1.2em;font-weight:600;margin:6px 0;color:{color}'>{html.escape(text)}</div>"

    def thresholds(self) -> Thresholds:
        return Thresholds(utilization=self.utilization.value / 100, comm_frac=self.comm_frac.value / 100)

    def on_decision(self, decision: Decision) -> None:
        self.decisions.append(decision)
        self.status.value = self._line(decision_line(decision))
        self.table.value = trials_table_html(self.decisions)
        self.flowchart.value = render_png(flowchart_figure(decision.node, visited_nodes(self.decisions),
                                                           self.thresholds()))

    def start(self) -> OptimizationResult | None:
        """Run the loop with the sliders' settings; any error ends up in the status line, not lost."""
        self.decisions, self.result = [], None
        self.start_button.disabled = True
        self.status.value = self._line("measuring the baseline…")
        try:
            self.result = optimize(self.config, self.nproc, thresholds=self.thresholds(),
                                   max_trials=self.max_trials.value, time_budget_s=float(self.time_budget.value),
                                   on_decision=self.on_decision, **self.optimize_kwargs)
        except Exception as error:  # noqa: BLE001 — a button callback would swallow it: shown instead
            self.status.value = self._line(f"Failed: {type(error).__name__}: {error}", "#b00020")
            return None
        finally:
            self.start_button.disabled = False
        r = self.result
        self.status.value = self._line(f"done in {r.wall_s:.0f} s, {r.trials} trial(s), {r.speedup:.2f}× the "
                                       f"baseline; {r.stopped_because}")
        return r

    def widget(self) -> W.Widget:
        controls = [self.utilization, self.comm_frac, self.max_trials, self.time_budget, self.start_button]
        return W.VBox([W.HTML("<h3>Optimisation advisor</h3>"), *controls, self.status, self.flowchart, self.table])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
