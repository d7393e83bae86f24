"""A ratio with its rounds: how a benchmark says "A takes r× B's time", and when it may say "faster".

A benchmark runs A and B in interleaved rounds (A B, then B A, …) so that a slow minute of a shared machine
falls on both. One round gives one ratio; the rounds together give its median and its interquartile range
(IQR: the middle half of the rounds). The rule labkit's benchmarks keep:

* at least :data:`MIN_ROUNDS` rounds, every round kept in the results file;
* "faster" or "slower" only when the whole IQR lies on one side of 1.0; otherwise "no clear difference";
* a series that drifts (the rounds rising or falling in turn, not scattering) is reported as drift: its
  median describes no steady state. :func:`drift` measures it as the rank correlation of the rounds with
  their order (Spearman's ρ), and calls it drift when |ρ| ≥ :data:`DRIFT_RHO` over 6 or more rounds.
"""
from __future__ import annotations

import random
import statistics

MIN_ROUNDS = 6
DRIFT_RHO = 0.8


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The first quartile, the median and the third (``statistics.quantiles``' inclusive method)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def bootstrap_median_interval(values: list[float], resamples: int = 10_000, level: float = 0.95,
                              seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of ``values`` (the rounds resampled with replacement,
    ``resamples`` times, seeded: the same rounds give the same interval)."""
    if not values:
        raise ValueError("a bootstrap interval needs at least one value")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"resamples must be >= 1 and level in (0, 1), got {resamples} and {level}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[round((1 - tail) * (resamples - 1))]


def drift(values: list[float]) -> float:
    """Spearman's ρ between the rounds and their order: +1 every round above the one before, −1 below."""
    n = len(values)
    if n < 3:
        return 0.0
    order = sorted(range(n), key=lambda i: values[i])
    ranks = [0.0] * n
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    mean = (n - 1) / 2
    cov = sum((r - mean) * (i - mean) for i, r in enumerate(ranks))
    var = sum((i - mean) ** 2 for i in range(n))
    return cov / var


def verdict(q1: float, q3: float, lower_is_faster: bool = True) -> str:
    """'faster' / 'slower' when the IQR [q1, q3] of a time ratio excludes 1.0, else 'no clear difference'."""
    if q3 < 1.0:
        return "faster" if lower_is_faster else "slower"
    if q1 > 1.0:
        return "slower" if lower_is_faster else "faster"
    return "no clear difference"


def ratio_summary(rounds: list[float], lower_is_faster: bool = True) -> dict:
    """What a results row records of a ratio: every round, the median, the IQR, the verdict and the drift."""
    q1, median, q3 = quartiles(rounds)
    rho = drift(rounds)
    drifting = len(rounds) >= MIN_ROUNDS and abs(rho) >= DRIFT_RHO
    return {"rounds": list(rounds), "n_rounds": len(rounds), "median": median, "q1": q1, "q3": q3,
            "verdict": verdict(q1, q3, lower_is_faster), "drift_rho": rho, "drifting": drifting,
            "enough_rounds": len(rounds) >= MIN_ROUNDS}


def describe(summary: dict, what: str = "ratio") -> str:
    """One line: 'ratio 0.93 (IQR 0.90–0.97, 8 rounds): faster' — and the drift when the series drifts."""
    line = (f"{what} {summary['median']:.3f} (IQR {summary['q1']:.3f}–{summary['q3']:.3f}, "
            f"{summary['n_rounds']} rounds): {summary['verdict']}")
    if summary["drifting"]:
        line += f"; the rounds DRIFT (Spearman ρ {summary['drift_rho']:+.2f}): no steady state to quote"
    if not summary["enough_rounds"]:
        line += f"; fewer than {MIN_ROUNDS} rounds: not a measurement to quote"
    return line
