"""Chinchilla approach 3: fit ``L(N, D) = E + A/N^alpha + B/D^beta`` to every run at once.

Approaches 1 and 2 only locate the compute-optimal frontier; approach 3 models the
whole loss surface, so it can also *predict the loss* of a run nobody trained. The
recipe follows Hoffmann et al. 2022, appendix D.2, step by step:

* **Log-sum-exp parametrisation.** Write ``A = exp(a)``, ``B = exp(b)``,
  ``E = exp(e)``. Then ``log L = LSE(a - alpha log N, b - beta log D, e)``, where
  ``LSE`` is log-sum-exp. The three positive terms stay positive for any real
  ``(a, b, e)``, so the optimiser needs no constraints, and the numbers it sees are
  all of order one even though ``A`` may be 400 and ``N`` a billion.
* **Residuals of log-loss.** A 1% error is a 1% error whether the loss is 4 or 2;
  in log space both weigh the same, so the small, long runs are not drowned out.
* **Huber loss with delta = 1e-3.** Quadratic for tiny residuals, linear beyond
  ``delta``. A run that diverged or was cut short pulls on the fit with constant
  force instead of with the square of its error, so one bad run cannot drag the
  exponents (the fit behaves much like a least-absolute-deviations fit).
* **L-BFGS from a grid of initialisations.** The objective is not convex: it has
  local minima where one term is "switched off" (e.g. ``alpha`` very large). Many
  starts, keep the best.

Speed note: Hoffmann et al. run L-BFGS from *every* point of their 4,500-point grid
(minutes in NumPy). By default we evaluate the objective at every grid point (one
cheap vectorised pass) and polish only the ``n_starts`` most promising points with
L-BFGS. That coarsening keeps the grid's coverage at a fraction of the cost; pass
``n_starts=None`` for Hoffmann's exhaustive search.

A caution worth teaching: Besiroglu et al. 2024 ("Chinchilla scaling: a replication
attempt") refitted Hoffmann's own data and found the published approach-3 values
(and their very narrow intervals) hard to reproduce, partly because the original
optimiser stopped early. Tight tolerances below are deliberate.
"""
import itertools
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from labkit.scaling._checks import (
    as_positive_array,
    require_enough_points,
    require_same_length,
    require_spread,
)

PARAMETER_NAMES = ("E", "A", "B", "alpha", "beta")
HUBER_DELTA = 1e-3

# Hoffmann et al. 2022, appendix D.2: the grid the L-BFGS runs start from.
HOFFMANN_GRID = {
    "alpha": np.arange(0.0, 2.01, 0.5),
    "beta": np.arange(0.0, 2.01, 0.5),
    "e": np.arange(-1.0, 1.01, 0.5),
    "a": np.arange(0.0, 25.1, 5.0),
    "b": np.arange(0.0, 25.1, 5.0),
}

# Tight tolerances: the objective is a sum of tiny Huber terms, and stopping early
# is exactly the failure the replication study found.
_LBFGS_OPTIONS = {"maxiter": 5000, "ftol": 1e-14, "gtol": 1e-10}


@dataclass(frozen=True)
class ParametricLossFit:
    """``L(N, D) = E + A/N^alpha + B/D^beta``, with bootstrap 95% intervals."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    intervals: dict  # name -> (low, high), percentile bootstrap; NaN if n_bootstrap == 0
    bootstrap_samples: np.ndarray = field(repr=False)  # (n_bootstrap, 5) in PARAMETER_NAMES order
    residuals: np.ndarray = field(repr=False)  # log(observed) - log(predicted), per point
    objective: float = field(repr=False)  # the minimised sum of Huber terms, divided by delta

    @property
    def params(self) -> dict:
        """The five parameters by name: what the allocation functions take."""
        return {name: getattr(self, name) for name in PARAMETER_NAMES}

    def predict(self, n_params, tokens) -> np.ndarray:
        """Predicted loss for models of ``n_params`` parameters trained on ``tokens`` tokens."""
        n, d = np.asarray(n_params, dtype=float), np.asarray(tokens, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta


def _log_loss(theta, log_n, log_d):
    """``LSE(a - alpha log N, b - beta log D, e)``, i.e. ``log(E + A/N^alpha + B/D^beta)``.

    ``theta`` unpacks to ``(a, b, e, alpha, beta)``; each may be an array that
    broadcasts against ``log_n`` (used to score many starts at once).
    """
    a, b, e, alpha, beta = theta
    return np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)


def _huber_over_delta(residual: np.ndarray, delta: float) -> np.ndarray:
    """Huber(residual) / delta: ``r^2 / (2 delta)`` inside ``|r| <= delta``, ``|r| - delta/2`` outside.

    Dividing by ``delta`` does not move the minimum; it keeps the objective of order
    one so that L-BFGS's absolute tolerances mean something.
    """
    size = np.abs(residual)
    return np.where(size <= delta, 0.5 * residual**2 / delta, size - 0.5 * delta)


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                    delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """The approach-3 objective at ``theta = (a, b, e, alpha, beta)``, and its gradient."""
    a, b, e, alpha, beta = theta
    residual = _log_loss(theta, log_n, log_d) - log_loss
    # d LSE / d term is the softmax of the three terms.
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    weights = np.exp(terms - terms.max(axis=0))
    weights /= weights.sum(axis=0)
    slope = np.clip(residual, -delta, delta) / delta  # d Huber/delta / d residual
    gradient = np.array([
        slope @ weights[0],
        slope @ weights[1],
        slope @ weights[2],
        -(slope * weights[0]) @ log_n,
        -(slope * weights[1]) @ log_d,
    ])
    return float(_huber_over_delta(residual, delta).sum()), gradient


def _grid_starts(grid: dict) -> np.ndarray:
    """Every combination of the grid as rows ``(a, b, e, alpha, beta)``."""
    return np.array(list(itertools.product(grid["a"], grid["b"], grid["e"], grid["alpha"], grid["beta"])))


def _objective_at_each_start(starts: np.ndarray, log_n, log_d, log_loss, delta: float) -> np.ndarray:
    """The objective at every start, in one vectorised pass (no gradients, no optimising)."""
    residual = _log_loss(starts.T[:, :, None], log_n, log_d) - log_loss
    return _huber_over_delta(residual, delta).sum(axis=1)


def _minimise(start: np.ndarray, log_n, log_d, log_loss, delta: float):
    return minimize(huber_objective, start, args=(log_n, log_d, log_loss, delta),
                    jac=True, method="L-BFGS-B", options=_LBFGS_OPTIONS)


def _best_of_grid(log_n, log_d, log_loss, grid: dict, n_starts, delta: float):
    starts = _grid_starts(grid)
    if n_starts is not None:
        ranked = np.argsort(_objective_at_each_start(starts, log_n, log_d, log_loss, delta))
        starts = starts[ranked[:n_starts]]
    results = [_minimise(start, log_n, log_d, log_loss, delta) for start in starts]
    return min(results, key=lambda result: result.fun)


def _as_named(theta: np.ndarray) -> np.ndarray:
    """``(a, b, e, alpha, beta)`` -> ``(E, A, B, alpha, beta)``."""
    a, b, e, alpha, beta = theta
    return np.array([np.exp(e), np.exp(a), np.exp(b), alpha, beta])


def _bootstrap(theta: np.ndarray, log_n, log_d, log_loss, n_bootstrap: int, seed: int, delta: float) -> np.ndarray:
    """Refit on resampled points, starting each refit at the full-data optimum."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n_bootstrap):
        pick = rng.integers(0, log_n.size, log_n.size)
        result = _minimise(theta, log_n[pick], log_d[pick], log_loss[pick], delta)
        samples.append(_as_named(result.x))
    return np.array(samples).reshape(n_bootstrap, len(PARAMETER_NAMES))


def fit_chinchilla_parametric(n_params, tokens, loss, *, n_bootstrap: int = 100, seed: int = 0,
                              grid: dict = HOFFMANN_GRID, n_starts: int | None = 32,
                              huber_delta: float = HUBER_DELTA) -> ParametricLossFit:
    """Chinchilla approach 3: fit ``E + A/N^alpha + B/D^beta`` to (N, D, final loss) per run.

    ``grid`` maps ``alpha, beta, e, a, b`` to the values to start from (Hoffmann's by
    default); ``n_starts`` is how many of the best grid points L-BFGS polishes
    (``None``: all of them, as in the paper). ``n_bootstrap`` resamples of the points,
    seeded by ``seed``, give the 95% percentile intervals.
    """
    n = as_positive_array("n_params", n_params)
    d = as_positive_array("tokens", tokens)
    observed = as_positive_array("loss", loss)
    points = require_same_length(n_params=n, tokens=d, loss=observed)
    require_enough_points(points, len(PARAMETER_NAMES), "the approach-3 law E + A/N^alpha + B/D^beta")
    require_spread("n_params", n)
    require_spread("tokens", d)
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap must be >= 0, got {n_bootstrap}")
    if n_starts is not None and n_starts < 1:
        raise ValueError(f"n_starts must be at least 1 (or None for the whole grid), got {n_starts}")

    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(observed)
    best = _best_of_grid(log_n, log_d, log_loss, grid, n_starts, huber_delta)
    samples = _bootstrap(best.x, log_n, log_d, log_loss, n_bootstrap, seed, huber_delta)
    if n_bootstrap:
        low, high = np.percentile(samples, [2.5, 97.5], axis=0)
    else:
        low = high = np.full(len(PARAMETER_NAMES), np.nan)
    return ParametricLossFit(
        *map(float, _as_named(best.x)),
        intervals={name: (float(lo), float(hi)) for name, lo, hi in zip(PARAMETER_NAMES, low, high)},
        bootstrap_samples=samples,
        residuals=log_loss - _log_loss(best.x, log_n, log_d),
        objective=float(best.fun),
    )
