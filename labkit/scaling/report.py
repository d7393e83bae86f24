"""From a sweep's results to fitted laws: every fit labkit has, on the points a sweep measured.

``fit_sweep(results)`` returns the fits (each may be None with the reason it could not be made,
e.g. an IsoFLOP minimum outside the sizes tried), and ``fit_report`` prints them next to the one
number a real lab never has: the data's true entropy floor, which the fitted E should recover.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from labkit.scaling.fits import TrainingCurve, fit_chinchilla_envelope, fit_chinchilla_isoflop, fit_loss_vs_params
from labkit.scaling.parametric import fit_chinchilla_parametric


@dataclass
class SweepFits:
    parametric: Optional[object] = None  # approach 3: ParametricLossFit
    isoflop: Optional[object] = None  # approach 2: ComputeOptimalFit
    envelope: Optional[object] = None  # approach 1: ComputeOptimalFit
    kaplan_n: Optional[object] = None  # L(N) on the largest token budget
    floor: Optional[float] = None
    flops_per_second: Optional[float] = None  # achieved on this machine, median over the sweep
    problems: dict = field(default_factory=dict)


def final_losses(results: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, D, validation loss) of every point."""
    rows = [r for r in results if r.get("val_loss") is not None]
    return tuple(np.array([r[k] for r in rows], dtype=float) for k in ("params", "tokens", "val_loss"))


def achieved_flops_per_second(results: list[dict]) -> Optional[float]:
    rates = [r["tokens_per_s"] * r["flops"] / r["tokens"] for r in results if r.get("tokens_per_s")]
    return float(np.median(rates)) if rates else None


def _attempt(fits: SweepFits, name: str, make):
    try:
        return make()
    except ValueError as error:
        fits.problems[name] = str(error)
        return None


MIN_STEPS = 60
"""Runs shorter than this are left out of the fits: with a 20-step warm-up, a 30-step run is mostly warm-up,
and its loss says more about the schedule than about N and D (Hoffmann et al. also fit only runs long
enough for their cosine schedule to matter)."""


def fit_sweep(results: list[dict], n_bootstrap: int = 50, min_steps: int = MIN_STEPS) -> SweepFits:
    fits = SweepFits(floor=next((r["entropy_floor"] for r in results if r.get("entropy_floor")), None),
                     flops_per_second=achieved_flops_per_second(results))
    results = [r for r in results if r["steps"] >= min_steps]
    n, d, loss = final_losses(results)
    fits.parametric = _attempt(fits, "approach 3", lambda: fit_chinchilla_parametric(n, d, loss,
                                                                                  n_bootstrap=n_bootstrap))
    iso = [r for r in results if r.get("budget") and r.get("val_loss") is not None]
    fits.isoflop = _attempt(fits, "approach 2", lambda: fit_chinchilla_isoflop(
        [r["budget"] for r in iso], [r["params"] for r in iso], [r["val_loss"] for r in iso]))
    curves = [TrainingCurve(r["params"], [t for t, _ in r["curve"]], [v for _, v in r["curve"]])
              for r in results if r.get("budget") is None]
    fits.envelope = _attempt(fits, "approach 1", lambda: fit_chinchilla_envelope(curves, n_bootstrap=50))
    grid = [r for r in results if r.get("budget") is None]
    if grid:
        most = max(r["tokens"] for r in grid)
        largest = [r for r in grid if r["tokens"] == most]
        fits.kaplan_n = _attempt(fits, "Kaplan L(N)", lambda: fit_loss_vs_params(
            [r["params"] for r in largest], [r["val_loss"] for r in largest]))
    return fits


def fit_report(results: list[dict], fits: Optional[SweepFits] = None) -> str:
    """Every fit of a sweep as text; ``fits`` from :func:`fit_sweep` of the same results, or fitted here."""
    if not results:
        return "no finished sweep points"
    fits = fits or fit_sweep(results)
    used = sum(r["steps"] >= MIN_STEPS for r in results)
    lines = [f"{len(results)} points ({used} of at least {MIN_STEPS} steps fitted), "
             f"N {min(r['params'] for r in results):,}–{max(r['params'] for r in results):,} "
             f"parameters, D {min(r['tokens'] for r in results):,.0f}–{max(r['tokens'] for r in results):,.0f} tokens"]
    p = fits.parametric
    if p is not None:
        lines.append(f"approach 3: L = {p.E:.4f} + {p.A:.4g}/N^{p.alpha:.3f} + {p.B:.4g}/D^{p.beta:.3f}")
        if fits.floor:
            lines.append(f"  fitted E {p.E:.4f} vs the data's exact entropy floor {fits.floor:.4f}: "
                         f"{(p.E - fits.floor) / fits.floor:+.1%}")
        lines.append(f"  allocation exponent a = β/(α+β) = {p.beta / (p.alpha + p.beta):.3f}")
    for name, fit in (("approach 2 (IsoFLOP)", fits.isoflop), ("approach 1 (envelope)", fits.envelope)):
        if fit is not None:
            lines.append(f"{name}: N_opt ∝ C^{fit.a:.3f} (95% {fit.a_interval[0]:.3f}–{fit.a_interval[1]:.3f})")
    if fits.kaplan_n is not None:
        lines.append(f"Kaplan L(N) at the largest token budget: α_N = {fits.kaplan_n.alpha:.3f}")
    lines += [f"{name}: not fitted — {why}" for name, why in fits.problems.items()]
    if fits.flops_per_second:
        lines.append(f"achieved on this machine: {fits.flops_per_second / 1e9:.2f} GFLOP/s (median over the sweep)")
    return "\n".join(lines)
