"""The scaling-laws lab: a sweep's curves, its IsoFLOP profiles, the fitted surface, and a planner.

Every picture is a pure function of a sweep's results (``labkit.scaling.sweep``) and the fits made
from them (``labkit.scaling.report.fit_sweep``), so the figures are tested without a kernel. The
:class:`BudgetPlanner` widget turns a budget in hours on *this* machine (its FLOP/s measured by the
sweep itself) into a model size, tokens, steps and a predicted loss.
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from labkit.plots import label_axes
from labkit.scaling.allocation import CHINCHILLA_PUBLISHED, kaplan_allocation, optimal_allocation
from labkit.scaling.planner import plan
from labkit.scaling.report import MIN_STEPS


def _sizes(results: list[dict]) -> list[int]:
    return sorted({r["params"] for r in results})


def curves_figure(results: list[dict], floor: Optional[float] = None) -> Figure:
    """Training curves (smoothed train loss) of the longest run per size; final validation losses as dots."""
    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
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
    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
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
    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
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
    label_axes(ax, "Fitted law (lines) against measured points (dots; hollow: too short to fit)", "tokens D",
               "final validation loss")
    ax.legend(fontsize=9, ncol=2)
    return fig


def allocation_figure(fitted: Optional[dict], flops=np.logspace(15, 25, 60)) -> Figure:
    """Compute-optimal model size against budget: the fit from this sweep, Chinchilla's published fit,
    and Kaplan's allocation — the two papers disagree most at large budgets."""
    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    if fitted is not None:
        ax.plot(flops, optimal_allocation(flops, fitted)[0], lw=2.5, label="fitted on this sweep")
    ax.plot(flops, optimal_allocation(flops, CHINCHILLA_PUBLISHED)[0], lw=2, label="Chinchilla (Hoffmann et al. 2022)")
    ax.plot(flops, kaplan_allocation(flops)[0], lw=2, ls="--", label="Kaplan et al. 2020")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label_axes(ax, "Compute-optimal model size N_opt(C)", "training compute C (FLOPs)", "parameters")
    return fig


def plan_table_html(the_plan) -> str:
    rows = "".join(
        f"<tr style='{'font-weight:700;background:#eef' if c is the_plan.recommended else ''}'>"
        f"<td>{c.n_params:,.0f}</td><td>{c.tokens:,.0f}</td><td>{c.tokens_per_parameter:.1f}</td>"
        f"<td>{'' if c.steps is None else f'{c.steps:,}'}</td><td>{c.predicted_loss:.4f}</td>"
        f"<td>{'' if c.wall_seconds is None else f'{c.wall_seconds / 60:.1f}'}</td></tr>"
        for c in the_plan.choices)
    head = "".join(f"<th>{h}</th>" for h in ("parameters", "tokens", "tokens/param", "steps", "predicted loss",
                                              "minutes here"))
    return (f"<table style='font-size:1.1em;border-collapse:collapse' cellpadding='6'><tr>{head}</tr>{rows}</table>"
            f"<div>budget {the_plan.flops:.3g} FLOPs; bold: compute-optimal</div>")


class BudgetPlanner:
    """A budget slider (minutes on this machine) → N_opt, D_opt, steps, predicted loss, wall time."""

    def __init__(self, fitted: dict, flops_per_second: float, tokens_per_step: int):
        self.fitted, self.rate, self.tokens_per_step = fitted, flops_per_second, tokens_per_step
        style, layout = {"description_width": "160px"}, W.Layout(width="520px")
        self.minutes = W.FloatLogSlider(value=10, base=10, min=-0.5, max=3, step=0.05,
                                        description="budget (minutes)", style=style, layout=layout)
        self.law = W.ToggleButtons(options=["fitted on this sweep", "Chinchilla published"],
                                   value="fitted on this sweep")
        self.table = W.HTML()
        self.minutes.observe(lambda _: self.update(), names="value")
        self.law.observe(lambda _: self.update(), names="value")
        self.update()

    def current_plan(self):
        fit = self.fitted if self.law.value == "fitted on this sweep" else CHINCHILLA_PUBLISHED
        return plan(budget_hours=self.minutes.value / 60, flops_per_second=self.rate, fit=fit,
                    tokens_per_step=self.tokens_per_step)

    def update(self) -> None:
        self.table.value = plan_table_html(self.current_plan())

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Budget planner</h3>"), self.minutes, self.law, self.table])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


__all__ = ["curves_figure", "isoflop_figure", "surface_figure", "allocation_figure", "BudgetPlanner",
           "plan_table_html"]
