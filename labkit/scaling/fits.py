"""Scaling-law fits: Kaplan's power laws and Chinchilla's three approaches.

Every fit returns a small frozen dataclass holding the fitted parameters, their
uncertainty, the residuals (``log(observed) - log(predicted)``, so a residual of
0.01 means "1% above the curve"), and a ``predict`` method.

* Kaplan et al. 2020: ``fit_loss_vs_params``, ``fit_loss_vs_tokens``,
  ``fit_loss_vs_params_and_tokens``: least squares in log space.
* Hoffmann et al. 2022 ("Chinchilla"), three ways to find the compute-optimal
  model size ``N_opt(C)``:
  1. ``fit_chinchilla_envelope``: the lowest loss reached at each FLOP count,
     across training curves of many model sizes;
  2. ``fit_chinchilla_isoflop``: a parabola through loss vs log N at each fixed
     budget, its minimum is ``N_opt(C)``;
  3. ``fit_chinchilla_parametric`` (in ``parametric.py``): the whole surface
     ``E + A/N^alpha + B/D^beta``.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats
from scipy.optimize import least_squares

from labkit.scaling._checks import (
    as_positive_array,
    as_positive_number,
    require_enough_points,
    require_same_length,
    require_spread,
)
from labkit.scaling.parametric import (
    HOFFMANN_GRID,
    ParametricLossFit,
    fit_chinchilla_parametric,
)

__all__ = [
    "HOFFMANN_GRID", "ComputeOptimalFit", "KaplanJointLaw", "KaplanPowerLaw", "ParametricLossFit",
    "TrainingCurve", "fit_chinchilla_envelope", "fit_chinchilla_isoflop", "fit_chinchilla_parametric",
    "fit_loss_vs_params", "fit_loss_vs_params_and_tokens", "fit_loss_vs_tokens",
]


def _fit_line(x: np.ndarray, y: np.ndarray):
    """Ordinary least squares ``y = c0 + c1 x``: coefficients, their covariance, residuals.

    The covariance is NaN when there are no spare points (two points, two unknowns):
    a line through two points always fits perfectly, so the data say nothing about error.
    """
    design = np.column_stack([np.ones_like(x), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residuals = y - design @ coef
    spare = x.size - 2
    if spare <= 0:
        return coef, np.full((2, 2), np.nan), residuals
    return coef, residuals @ residuals / spare * np.linalg.inv(design.T @ design), residuals


# ---------------------------------------------------------------- Kaplan et al. 2020

@dataclass(frozen=True)
class KaplanPowerLaw:
    """``L(x) = (x_c / x)^alpha`` for one resource x (parameters N or tokens D)."""

    x_c: float
    alpha: float
    alpha_stderr: float
    log_x_c_stderr: float  # the error of x_c is multiplicative, so it lives in log space
    residuals: np.ndarray = field(repr=False)

    def predict(self, x) -> np.ndarray:
        return (self.x_c / np.asarray(x, dtype=float)) ** self.alpha


def _fit_kaplan_single(name: str, x, loss) -> KaplanPowerLaw:
    """``log L = alpha log x_c - alpha log x``: a straight line in log-log coordinates."""
    x = as_positive_array(name, x)
    loss = as_positive_array("loss", loss)
    require_enough_points(require_same_length(**{name: x, "loss": loss}), 2, f"L({name}) = ({name}_c/{name})^alpha")
    require_spread(name, x)
    (c0, c1), cov, residuals = _fit_line(np.log(x), np.log(loss))
    if c1 >= 0:
        raise ValueError(f"loss does not fall as {name} grows (log-log slope {c1:.3g}); "
                         f"no power law with alpha > 0 fits")
    gradient = np.array([-1 / c1, c0 / c1**2])  # of log x_c = -c0/c1, for the delta method
    return KaplanPowerLaw(float(np.exp(-c0 / c1)), float(-c1), float(np.sqrt(cov[1, 1])),
                          float(np.sqrt(gradient @ cov @ gradient)), residuals)


def fit_loss_vs_params(n_params, loss) -> KaplanPowerLaw:
    """Kaplan's ``L(N) = (N_c/N)^alpha_N``: models trained to convergence on plenty of data."""
    return _fit_kaplan_single("n_params", n_params, loss)


def fit_loss_vs_tokens(tokens, loss) -> KaplanPowerLaw:
    """Kaplan's ``L(D) = (D_c/D)^alpha_D``: large models, early-stopped, on D tokens."""
    return _fit_kaplan_single("tokens", tokens, loss)


@dataclass(frozen=True)
class KaplanJointLaw:
    """``L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D`` (Kaplan et al. 2020, eq. 1.5)."""

    n_c: float
    d_c: float
    alpha_n: float
    alpha_d: float
    stderr: dict  # of "log_n_c", "log_d_c", "alpha_n", "alpha_d"
    residuals: np.ndarray = field(repr=False)

    def predict(self, n_params, tokens) -> np.ndarray:
        n, d = np.asarray(n_params, dtype=float), np.asarray(tokens, dtype=float)
        return ((self.n_c / n) ** (self.alpha_n / self.alpha_d) + self.d_c / d) ** self.alpha_d


def _kaplan_joint_log_loss(theta, log_n, log_d):
    log_n_c, log_d_c, alpha_n, alpha_d = theta
    return alpha_d * np.logaddexp(alpha_n / alpha_d * (log_n_c - log_n), log_d_c - log_d)


def fit_loss_vs_params_and_tokens(n_params, tokens, loss) -> KaplanJointLaw:
    """Kaplan's joint law, by nonlinear least squares on log-loss from a few starts.

    Each start places ``N_c`` and ``D_c`` where its own term alone would equal the
    median loss, for exponents between 0.05 and 0.5; the best least-squares fit wins.
    Standard errors come from the Jacobian at the optimum (``s^2 (J^T J)^-1``).
    """
    n, d = as_positive_array("n_params", n_params), as_positive_array("tokens", tokens)
    observed = as_positive_array("loss", loss)
    points = require_same_length(n_params=n, tokens=d, loss=observed)
    require_enough_points(points, 4, "Kaplan's L(N, D)")
    require_spread("n_params", n)
    require_spread("tokens", d)
    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(observed)

    def residual(theta):
        return log_loss - _kaplan_joint_log_loss(theta, log_n, log_d)

    typical = np.median(log_loss)
    exponents = (0.05, 0.1, 0.2, 0.5)
    starts = [[np.median(log_n) + typical / a_n, np.median(log_d) + typical / a_d, a_n, a_d]
              for a_n in exponents for a_d in exponents]
    bounds = ([-np.inf, -np.inf, 1e-6, 1e-6], np.inf)
    best = min((least_squares(residual, s, bounds=bounds, x_scale="jac") for s in starts), key=lambda r: r.cost)
    spare = max(points - 4, 0)
    variance = 2 * best.cost / spare if spare else np.nan
    errors = np.sqrt(np.diag(variance * np.linalg.pinv(best.jac.T @ best.jac)))
    log_n_c, log_d_c, alpha_n, alpha_d = best.x
    return KaplanJointLaw(float(np.exp(log_n_c)), float(np.exp(log_d_c)), float(alpha_n), float(alpha_d),
                          dict(zip(("log_n_c", "log_d_c", "alpha_n", "alpha_d"), map(float, errors))),
                          residual(best.x))


# ---------------------------------------------------------------- compute-optimal frontier

@dataclass(frozen=True)
class ComputeOptimalFit:
    """``N_opt(C) = n_scale C^a`` and ``D_opt(C) = d_scale C^b`` (Chinchilla approaches 1 and 2).

    Because every point satisfies ``C = 6 N D``, the two regressions are tied:
    ``a + b = 1`` and ``n_scale * d_scale = 1/6``. Chinchilla reports both anyway.
    """

    a: float
    b: float
    n_scale: float
    d_scale: float
    a_interval: tuple  # 95% interval for a
    flops: np.ndarray = field(repr=False)  # budgets at which an optimum was measured
    n_opt: np.ndarray = field(repr=False)  # the measured optimal model sizes
    residuals: np.ndarray = field(repr=False)  # log(n_opt) - log(predicted n_opt)

    @property
    def b_interval(self) -> tuple:
        return (1 - self.a_interval[1], 1 - self.a_interval[0])

    def predict(self, flops) -> tuple[np.ndarray, np.ndarray]:
        """``(N_opt, D_opt)`` at budget(s) ``flops``."""
        c = np.asarray(flops, dtype=float)
        return self.n_scale * c**self.a, self.d_scale * c**self.b


def _frontier_fit(flops: np.ndarray, n_opt: np.ndarray, a_interval=None) -> ComputeOptimalFit:
    """Regress log N_opt and log D_opt = log(C / 6 N_opt) on log C."""
    log_c = np.log(flops)
    (n0, a), cov, residuals = _fit_line(log_c, np.log(n_opt))
    (d0, b), _, _ = _fit_line(log_c, np.log(flops / (6 * n_opt)))
    if a_interval is None:  # t interval: few budgets, so not the normal 1.96
        half = stats.t.ppf(0.975, flops.size - 2) * np.sqrt(cov[1, 1]) if flops.size > 2 else np.nan
        a_interval = (a - half, a + half)
    return ComputeOptimalFit(float(a), float(b), float(np.exp(n0)), float(np.exp(d0)),
                             tuple(map(float, a_interval)), flops, n_opt, residuals)


@dataclass(frozen=True)
class TrainingCurve:
    """One run for approach 1: its model size and the loss logged as tokens went by."""

    n_params: float
    tokens: Sequence[float]  # tokens seen at each logged point, increasing
    loss: Sequence[float]


def _log_flops_and_log_loss(curve: TrainingCurve, index: int) -> tuple[np.ndarray, np.ndarray]:
    n = as_positive_number(f"curves[{index}].n_params", curve.n_params)
    tokens = as_positive_array(f"curves[{index}].tokens", curve.tokens)
    loss = as_positive_array(f"curves[{index}].loss", curve.loss)
    require_same_length(**{f"curves[{index}].tokens": tokens, f"curves[{index}].loss": loss})
    if tokens.size < 2 or np.any(np.diff(tokens) <= 0):
        raise ValueError(f"curves[{index}].tokens must hold at least two strictly increasing values")
    return np.log(6 * n * tokens), np.log(loss)


def _envelope(n_params: np.ndarray, logs: list, n_grid: int) -> tuple[np.ndarray, np.ndarray]:
    """``(C, N_opt)`` where the lowest-loss run at C is bracketed by a smaller and a larger one.

    Where the winner is the smallest (or largest) model that has reached C, a size we
    did not train might have done better, so that stretch of the envelope is dropped.
    """
    log_c = np.linspace(min(c[0] for c, _ in logs), max(c[-1] for c, _ in logs), n_grid)
    loss = np.array([np.interp(log_c, c, ll, left=np.inf, right=np.inf) for c, ll in logs])
    covered = np.isfinite(loss)
    winner = n_params[np.argmin(loss, axis=0)]
    smallest = np.where(covered, n_params[:, None], np.inf).min(axis=0)
    largest = np.where(covered, n_params[:, None], -np.inf).max(axis=0)
    keep = (smallest < winner) & (winner < largest)
    if np.unique(winner[keep]).size < 2:
        raise ValueError("fewer than two model sizes win a bracketed stretch of the envelope; "
                         "train more sizes, or train each for longer so the curves overlap")
    return np.exp(log_c[keep]), winner[keep]


def fit_chinchilla_envelope(curves: Sequence[TrainingCurve], *, n_grid: int = 1500,
                            n_bootstrap: int = 200, seed: int = 0) -> ComputeOptimalFit:
    """Chinchilla approach 1: the minimum-loss envelope over FLOPs, then a power law.

    At each of ``n_grid`` log-spaced FLOP counts ``C = 6 N D``, the run with the
    lowest (interpolated) loss gives ``N_opt(C)``. Envelope points are strongly
    correlated, so the interval for ``a`` comes from a seeded bootstrap over *runs*
    (a duplicated run leaves a minimum unchanged, so each resample is its distinct runs).
    """
    if len(curves) < 3:
        raise ValueError(f"approach 1 needs at least 3 training curves, got {len(curves)}")
    logs = [_log_flops_and_log_loss(curve, i) for i, curve in enumerate(curves)]
    n_params = np.array([float(curve.n_params) for curve in curves])
    flops, n_opt = _envelope(n_params, logs, n_grid)

    rng = np.random.default_rng(seed)
    exponents = []
    for _ in range(n_bootstrap):
        runs = np.unique(rng.integers(0, len(curves), len(curves)))
        try:
            exponents.append(_frontier_fit(*_envelope(n_params[runs], [logs[i] for i in runs], n_grid)).a)
        except ValueError:  # too few distinct runs in this resample to bracket an optimum
            continue
    enough = len(exponents) >= max(n_bootstrap // 2, 1)
    interval = tuple(np.percentile(exponents, [2.5, 97.5])) if enough else (np.nan, np.nan)
    return _frontier_fit(flops, n_opt, interval)


def _isoflop_minimum(budget: float, log_n: np.ndarray, loss: np.ndarray, allow_extrapolation: bool) -> float:
    """The vertex of the parabola ``loss = c2 u^2 + c1 u + c0`` in ``u = log N``."""
    if np.unique(log_n).size < 3:
        raise ValueError(f"the IsoFLOP set at C={budget:.3g} needs at least 3 distinct model sizes for a parabola")
    c2, c1, _ = np.polyfit(log_n, loss, 2)
    if c2 <= 0:
        raise ValueError(f"the IsoFLOP profile at C={budget:.3g} curves downward (curvature {c2:.3g}), so it has "
                         "no minimum; add model sizes on both sides of the optimum")
    vertex = -c1 / (2 * c2)
    if not allow_extrapolation and not log_n.min() <= vertex <= log_n.max():
        raise ValueError(f"the IsoFLOP minimum at C={budget:.3g} lies at N={np.exp(vertex):.3g}, outside the sizes "
                         f"tried ({np.exp(log_n.min()):.3g} to {np.exp(log_n.max()):.3g}); widen the sweep")
    return float(np.exp(vertex))


def fit_chinchilla_isoflop(flops, n_params, loss, *, allow_extrapolation: bool = False) -> ComputeOptimalFit:
    """Chinchilla approach 2: one parabola per IsoFLOP set, then a power law through the minima.

    Points sharing a ``flops`` value form one IsoFLOP set (use the budget you
    targeted, not a recomputed ``6ND``). The parabola is in ``log N`` because the
    profile is close to symmetric there; its vertex is ``N_opt(C)`` and
    ``D_opt = C / (6 N_opt)``. The interval on ``a`` is a t interval from the
    regression across budgets.
    """
    c = as_positive_array("flops", flops)
    n = as_positive_array("n_params", n_params)
    observed = as_positive_array("loss", loss)
    require_same_length(flops=c, n_params=n, loss=observed)
    budgets = np.unique(c)
    require_enough_points(budgets.size, 2, "the power law N_opt = k C^a (one point per FLOP budget)")
    n_opt = np.array([_isoflop_minimum(b, np.log(n[c == b]), observed[c == b], allow_extrapolation) for b in budgets])
    return _frontier_fit(budgets, n_opt)
