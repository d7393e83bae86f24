"""Notebook 06's pictures: number formats, fp32 against bf16 on real runs, and the fp16 loss scaler.

``compare_precisions`` trains the same configuration (same seed, same data order) once per precision,
one run after the other so they do not share the cores, and returns each run's loss curve and summary.
The figures are pure functions of what it returns (and of ``labkit.precision``'s tables), tested
without a kernel.
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.config import Config
from labkit.experiments import sweep
from labkit.plots import label_axes
from labkit.precision import comparison_rows

COLORS = {"fp32": "C0", "bf16": "C1", "fp16": "C2", "fp8": "C3"}


def compare_precisions(config: Config, modes=("fp32", "bf16"), nproc: int = 2) -> dict[str, dict]:
    """One real run per precision mode, in turn; ``{mode: {"steps", "losses", "summary", "run_dir"}}``."""
    points = [(mode, {"precision.mode": mode, "run.name": f"{config.run.name}-{mode}"}) for mode in modes]
    return dict(zip(modes, sweep(config, nproc, points, loss_curve)))


def loss_curve(run, *_) -> dict:
    """What the comparison draws of one finished run: its loss per step, its summary, where it lives."""
    metrics = run.metrics
    return {"steps": metrics["step"], "losses": metrics["loss"], "summary": run.summary, "run_dir": run.run_dir}


def comparison_figure(results: dict[str, dict]) -> Figure:
    """Left: the loss curves on top of each other. Right: throughput per precision."""
    fig = Figure(figsize=(13, 4.6), dpi=100, layout="constrained")
    ax_loss, ax_tps = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    for mode, r in results.items():
        ax_loss.plot(r["steps"], r["losses"], lw=1.8, color=COLORS.get(mode), label=mode, alpha=0.85)
    floor = next((r["summary"].get("entropy_floor") for r in results.values() if r["summary"].get("entropy_floor")),
                 None)
    if floor:
        ax_loss.axhline(floor, ls="--", color="gray", label="entropy floor (exact)")
    label_axes(ax_loss, "Same seed, same data: the loss curves", "step", "train loss (nats/token)")
    rows = comparison_rows(results)
    bars = ax_tps.bar([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows],
                      color=[COLORS.get(r["mode"], "C4") for r in rows])
    for bar, r in zip(bars, rows):
        ax_tps.annotate(f"{r['tokens_per_s']:,.0f}\n×{r['speedup']:.2f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=11)
    ax_tps.margins(y=0.25)
    label_axes(ax_tps, "Throughput (steady state)", "precision", "tokens/s", legend=False)
    return fig


def formats_figure(rows: list[dict]) -> Figure:
    """Each format's range on a log₂ axis: subnormals (light), normal numbers (dark), eps written beside."""
    fig = Figure(figsize=(12, 3.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(reversed(rows)):
        lo, normal, hi = (math.log2(r[k]) for k in ("smallest_subnormal", "smallest_normal", "max"))
        ax.barh(i, normal - lo, left=lo, color="C0", alpha=0.3, label="subnormals (precision fades)" if i == 0 else None)
        ax.barh(i, hi - normal, left=normal, color="C0", label="normal numbers" if i == 0 else None)
        ax.text(hi + 3, i, f"eps = 2^{round(math.log2(r['eps']))}", va="center", fontsize=11)
    ax.set_yticks(range(len(rows)), [r["name"] for r in reversed(rows)], fontsize=12)
    ax.axvline(0, color="gray", lw=1)
    ax.set_xlim(right=max(math.log2(r["max"]) for r in rows) + 40)
    label_axes(ax, "Range of each format (log₂ of the magnitude)", "log₂ |x|", "", legend=True)
    return fig


def scaler_figure(trajectory: list[dict]) -> Figure:
    """The loss scale per step (log₂): it doubles after a run of clean steps and halves on each overflow;
    the overflowed steps (red) were skipped: the weights did not change."""
    fig = Figure(figsize=(12, 3.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    steps = [r["step"] for r in trajectory]
    ax.step(steps, [math.log2(r["scale_before"]) for r in trajectory], where="post", lw=2, label="loss scale used")
    bad = [r for r in trajectory if r["overflow"]]
    ax.scatter([r["step"] for r in bad], [math.log2(r["scale_before"]) for r in bad], s=120, color="#C44E52",
               zorder=3, label="overflow: step skipped, scale halved")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    label_axes(ax, "A GradScaler at work (real torch.amp.GradScaler, CPU)", "step", "log₂ loss scale")
    return fig
