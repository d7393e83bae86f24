"""The scaling-laws lab: a sweep's curves, its IsoFLOP profiles, the fitted surface, and a planner.

Every picture is a pure function of a sweep's results (``labkit.scaling.sweep``) and the fits made
from them (``labkit.scaling.report.fit_sweep``), so the figures are tested without a kernel. The
:class:`BudgetPlanner` widget turns a budget in hours on *this* machine (its FLOP/s measured by the
sweep itself) into a model size, tokens, steps and a predicted loss.
"""
from __future__ import annotations

from html import escape
from typing import Optional

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from labkit.plots import FIGURE_WIDTH, label_axes
from labkit.scaling.allocation import CHINCHILLA_PUBLISHED, kaplan_allocation, optimal_allocation
from labkit.scaling.planner import below_floor, floor_note, plan
from labkit.scaling.report import MIN_STEPS



def _sizes(results: list[dict]) -> list[int]:
    return sorted({r["params"] for r in results})


def curves_figure(results: list[dict], floor: Optional[float] = None) -> Figure:
    """Training curves (smoothed train loss) of the longest run per size; final validation losses as dots."""
    fig = Figure(figsize=(FIGURE_WIDTH, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    grid = [r for r in results if r.get("budget") is None]
    for i, n in enumerate(_sizes(grid)):
        runs = sorted((r for r in grid if r["params"] == n), key=lambda r: r["tokens"])
        tokens, loss = zip(*runs[-1]["curve"])
        ax.plot(tokens, loss, color=f"C{i}", lw=1.5, alpha=0.8, label=f"N = {n:,}")
        ax.plot([r["tokens"] for r in runs], [r["val_loss"] for r in runs], "o", color=f"C{i}")
    if floor:
        ax.axhline(floor, ls="--", color="gray", label=f"entropy floor {floor:.4f}")
    ax.set_xscale("log")
    label_axes(ax, "Loss against tokens: bigger models learn faster and go lower", "tokens seen",
               "loss (nats/token; dots: final validation)")
    return fig


def isoflop_figure(results: list[dict], fit=None) -> Figure:
    """Chinchilla approach 2: at each fixed compute budget, loss against model size, and its parabola."""
    fig = Figure(figsize=(FIGURE_WIDTH, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    budgets = sorted({r["budget"] for r in results if r.get("budget")})
    for i, c in enumerate(budgets):
        pts = sorted((r for r in results if r.get("budget") == c), key=lambda r: r["params"])
        _excluded(ax, pts, "params", f"C{i}")
        pts = [r for r in pts if r["steps"] >= MIN_STEPS]
        n, loss = np.array([r["params"] for r in pts], float), np.array([r["val_loss"] for r in pts])
        ax.plot(n, loss, "o", color=f"C{i}", label=f"C = {c:.1e} FLOPs")
        if len(n) >= 3:
            coef = np.polyfit(np.log(n), loss, 2)
            u = np.linspace(np.log(n).min(), np.log(n).max(), 100)
            ax.plot(np.exp(u), np.polyval(coef, u), color=f"C{i}", lw=1.5)
    if fit is not None:  # fit.flops are the same sorted budgets: colours match
        for i, n_opt in enumerate(fit.n_opt):
            ax.axvline(n_opt, color=f"C{i}", ls=":", lw=1.5, label="N_opt(C)" if i == 0 else None)
    ax.set_xscale("log")
    label_axes(ax, "IsoFLOP profiles: for each budget, the best size is the bottom of the curve",
               "parameters N", "final validation loss")
    return fig


def _excluded(ax, points: list[dict], x: str, color: str) -> None:
    """Runs too short to fit (mostly warm-up, see ``labkit.scaling.report.MIN_STEPS``): hollow markers."""
    short = [r for r in points if r["steps"] < MIN_STEPS]
    ax.plot([r[x] for r in short], [r["val_loss"] for r in short], "o", mfc="none", color=color)


def surface_figure(results: list[dict], parametric, floor: Optional[float] = None) -> Figure:
    """The fitted L(N, D) = E + A/N^α + B/D^β against the measured points, with E against the true floor."""
    fig = Figure(figsize=(FIGURE_WIDTH, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    d_line = np.logspace(np.log10(min(r["tokens"] for r in results)), np.log10(max(r["tokens"] for r in results)), 80)
    for i, n in enumerate(_sizes(results)):
        pts = [r for r in results if r["params"] == n]
        _excluded(ax, pts, "tokens", f"C{i % 10}")
        pts = [r for r in pts if r["steps"] >= MIN_STEPS]
        ax.plot([r["tokens"] for r in pts], [r["val_loss"] for r in pts], "o", color=f"C{i % 10}", label=f"N = {n:,}")
        if parametric is not None:
            ax.plot(d_line, parametric.predict(n, d_line), color=f"C{i % 10}", lw=1.2)
    if parametric is not None:
        ax.axhline(parametric.E, color="black", ls="-.", label=f"fitted E = {parametric.E:.4f}")
    if floor:
        ax.axhline(floor, color="gray", ls="--", label=f"true entropy floor = {floor:.4f}")
    ax.set_xscale("log")
    label_axes(ax, "Fitted law (lines) against measured points\n(dots; hollow: too short to fit)", "tokens D",
               "final validation loss", legend=False)
    ax.legend(fontsize=11, ncol=2)
    return fig


def allocation_figure(fitted: Optional[dict], flops=np.logspace(15, 25, 60)) -> Figure:
    """Compute-optimal model size against budget: the fit from this sweep, Chinchilla's published fit,
    and Kaplan's allocation — the two papers disagree most at large budgets."""
    fig = Figure(figsize=(FIGURE_WIDTH, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    if fitted is not None:
        ax.plot(flops, optimal_allocation(flops, fitted)[0], lw=2.5, label="fitted on this sweep")
    ax.plot(flops, optimal_allocation(flops, CHINCHILLA_PUBLISHED)[0], lw=2, label="Chinchilla (Hoffmann et al. 2022)")
    ax.plot(flops, kaplan_allocation(flops)[0], lw=2, ls="--", label="Kaplan et al. 2020")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label_axes(ax, "Compute-optimal model size N_opt(C)", "training compute C (FLOPs)", "parameters")
    return fig


def _loss_cell(choice, under: list) -> str:
    """A predicted loss; marked (†, red) when it is below the data's entropy floor."""
    if any(choice is c for c in under):
        return f"<td style='color:#b00020'>{choice.predicted_loss:.4f} †</td>"
    return f"<td>{choice.predicted_loss:.4f}</td>"


def plan_table_html(the_plan, floor: Optional[float] = None, fit=None) -> str:
    """The plan as a table (bold: compute-optimal); with the data's entropy ``floor``, losses under it are marked
    and a note says what that means (:func:`labkit.scaling.planner.floor_note` of the law ``fit``)."""
    under = below_floor(the_plan, floor)
    rows = "".join(
        f"<tr style='{'font-weight:700;background:#eef' if c is the_plan.recommended else ''}'>"
        f"<td>{c.n_params:,.0f}</td><td>{c.tokens:,.0f}</td><td>{c.tokens_per_parameter:.1f}</td>"
        f"<td>{'' if c.steps is None else f'{c.steps:,}'}</td>{_loss_cell(c, under)}"
        f"<td>{'' if c.wall_seconds is None else f'{c.wall_seconds / 60:.1f}'}</td></tr>"
        for c in the_plan.choices)
    note = floor_note(the_plan, floor, fit if fit is not None else CHINCHILLA_PUBLISHED)
    head = "".join(f"<th>{h}</th>" for h in ("parameters", "tokens", "tokens/param", "steps", "predicted loss",
                                              "minutes here"))
    floor_line = f"; the data's entropy floor {floor:.4f} nats/token" if floor is not None else ""
    return (f"<table style='font-size:1.1em;border-collapse:collapse' cellpadding='6'><tr>{head}</tr>{rows}</table>"
            f"<div>budget {the_plan.flops:.3g} FLOPs; bold: compute-optimal{floor_line}</div>"
            + (f"<div style='max-width:880px;color:#8a1c00'>† {escape(note)}</div>" if note else ""))


class BudgetPlanner:
    """A budget slider (minutes on this machine) → N_opt, D_opt, steps, predicted loss, wall time."""

    def __init__(self, fitted: dict, flops_per_second: float, tokens_per_step: int, floor: Optional[float] = None):
        self.fitted, self.rate, self.tokens_per_step, self.floor = fitted, flops_per_second, tokens_per_step, floor
        style, layout = {"description_width": "160px"}, W.Layout(width="520px")
        self.minutes = W.FloatLogSlider(value=10, base=10, min=-0.5, max=3, step=0.05,
                                        description="budget (minutes)", style=style, layout=layout)
        self.law = W.ToggleButtons(options=["fitted on this sweep", "Chinchilla published"],
                                   value="fitted on this sweep", style={"button_width": "auto"})
        self.table = W.HTML()
        self.minutes.observe(lambda _: self.update(), names="value")
        self.law.observe(lambda _: self.update(), names="value")
        self.update()

    def law_params(self) -> dict:
        return self.fitted if self.law.value == "fitted on this sweep" else CHINCHILLA_PUBLISHED

    def current_plan(self):
        return plan(budget_hours=self.minutes.value / 60, flops_per_second=self.rate, fit=self.law_params(),
                    tokens_per_step=self.tokens_per_step)

    def update(self) -> None:
        self.table.value = plan_table_html(self.current_plan(), self.floor, self.law_params())

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Budget planner</h3>"), self.minutes, self.law, self.table])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


__all__ = ["curves_figure", "isoflop_figure", "surface_figure", "allocation_figure", "BudgetPlanner",
           "plan_table_html"]
