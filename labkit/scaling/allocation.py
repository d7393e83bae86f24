"""Compute-optimal allocation: how to split a FLOP budget between parameters and tokens.

Training a dense transformer of N parameters on D tokens costs ``C ~ 6 N D`` FLOPs
(2 per parameter per token forward, 4 backward). Fix C, and the approach-3 law
``L = E + A/N^alpha + B/D^beta`` becomes a function of N alone (``D = C / 6N``). Setting
its derivative to zero gives the closed form of Hoffmann et al. 2022, eq. (4):

    G = (alpha A / (beta B))^(1 / (alpha + beta)),   a = beta / (alpha + beta),   b = alpha / (alpha + beta)
    N_opt(C) = G (C/6)^a,                          D_opt(C) = G^-1 (C/6)^b

Since ``a + b = 1``, ``6 N_opt D_opt = C`` exactly. The exponents tell the story: if
data helps as much as parameters do (alpha ~ beta), a ~ b ~ 1/2 and model size and
tokens grow together. Kaplan et al. 2020 instead found ``N_opt ~ C^0.73``: spend a
growing budget mostly on a bigger model. ``kaplan_allocation`` is here for that
contrast; Chinchilla's lesson was that most large models of 2020-21 were undertrained.

Every function takes the law's parameters as a mapping with keys ``E, A, B, alpha,
beta`` (``CHINCHILLA_PUBLISHED``, or ``fit.params``), or a fit that has ``.params``.
"""
from collections.abc import Mapping

import numpy as np

from labkit.scaling._checks import as_positive_number

# Hoffmann et al. 2022, eq. (10), approach 3. Besiroglu et al. 2024 could not
# reproduce these from Hoffmann's own data; treat them as a reference, not truth.
CHINCHILLA_PUBLISHED = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}

# Kaplan et al. 2020, section 6.1 and figure 14: N_opt = 1.3e9 * C_min^0.73, with
# C_min in PF-days (1 PF-day = 1e15 FLOP/s * 86,400 s) and N counting non-embedding
# parameters only; D then follows from C = 6 N D.
KAPLAN_N_OPT_EXPONENT = 0.73
KAPLAN_N_OPT_AT_ONE_PF_DAY = 1.3e9
PF_DAY_FLOPS = 1e15 * 86_400


def _law(params) -> dict:
    """The five approach-3 parameters as floats, from a mapping or from a fit's ``.params``."""
    mapping = params.params if hasattr(params, "params") else params
    if not isinstance(mapping, Mapping):
        raise TypeError(f"expected a mapping with keys E, A, B, alpha, beta (or a fit), got {type(params).__name__}")
    missing = [key for key in ("E", "A", "B", "alpha", "beta") if key not in mapping]
    if missing:
        raise ValueError(f"scaling-law parameters are missing {', '.join(missing)}")
    law = {key: float(mapping[key]) for key in ("E", "A", "B", "alpha", "beta")}
    for key in ("A", "B", "alpha", "beta"):
        as_positive_number(key, law[key])
    return law


def _as_flops(flops) -> np.ndarray:
    c = np.asarray(flops, dtype=float)
    if not np.all(np.isfinite(c) & (c > 0)):
        raise ValueError(f"flops must be finite and positive, got {flops!r}")
    return c


def allocation_exponents(params) -> tuple[float, float]:
    """``(a, b)`` with ``N_opt ~ C^a`` and ``D_opt ~ C^b``: ``(beta, alpha) / (alpha + beta)``.

    The faster the loss falls with a resource (the larger its exponent), the *less*
    of the growing budget that resource needs: ``a`` carries beta, not alpha.
    """
    law = _law(params)
    total = law["alpha"] + law["beta"]
    return law["beta"] / total, law["alpha"] / total


def allocation_coefficient(params) -> float:
    """``G = (alpha A / (beta B))^(1/(alpha+beta))``: the model size at ``C/6 = 1``."""
    law = _law(params)
    ratio = law["alpha"] * law["A"] / (law["beta"] * law["B"])
    return ratio ** (1 / (law["alpha"] + law["beta"]))


def optimal_allocation(flops, params) -> tuple[np.ndarray, np.ndarray]:
    """``(N_opt, D_opt)`` minimising the approach-3 loss at budget(s) ``flops``; ``6 N D = C``."""
    c = _as_flops(flops)
    a, b = allocation_exponents(params)
    g = allocation_coefficient(params)
    return g * (c / 6) ** a, (c / 6) ** b / g


def predicted_loss(n_params, tokens, params) -> np.ndarray:
    """``E + A/N^alpha + B/D^beta``: the approach-3 prediction for N parameters, D tokens."""
    law = _law(params)
    n, d = np.asarray(n_params, dtype=float), np.asarray(tokens, dtype=float)
    return law["E"] + law["A"] / n ** law["alpha"] + law["B"] / d ** law["beta"]


def optimal_loss(flops, params) -> np.ndarray:
    """The lowest loss the law predicts for budget(s) ``flops``: at ``(N_opt, D_opt)``."""
    return predicted_loss(*optimal_allocation(flops, params), params)


def tokens_per_parameter(flops, params) -> np.ndarray:
    """``D_opt / N_opt`` at budget(s) ``flops``.

    The "20 tokens per parameter" rule of thumb is Chinchilla itself (70B parameters,
    1.4T tokens). It is not a constant of the law: the ratio grows like ``C^(b - a)``,
    so with the published approach-3 values it is ~26 at 1e18 FLOPs and ~93 at 6e23.
    """
    n, d = optimal_allocation(flops, params)
    return d / n


def kaplan_allocation(flops) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan et al. 2020's compute-efficient ``(N, D)`` at budget(s) ``flops``, for contrast.

    ``N = 1.3e9 (C / 1 PF-day)^0.73`` and ``D = C / (6 N)``. Why the papers differ
    is still argued: Hoffmann et al. blamed Kaplan's learning-rate schedule, fixed
    regardless of run length; Pearce & Song 2024 point to counting only non-embedding
    parameters at small scale; Porian et al. 2024 to last-layer FLOPs, warmup length
    and optimiser tuning (and find the schedule matters less than Hoffmann thought).
    """
    c = _as_flops(flops)
    n = KAPLAN_N_OPT_AT_ONE_PF_DAY * (c / PF_DAY_FLOPS) ** KAPLAN_N_OPT_EXPONENT
    return n, c / (6 * n)
