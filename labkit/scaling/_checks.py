"""Input checks shared by the scaling fits.

Every fit works on logarithms, so a zero, a negative number or a NaN does not
merely give a slightly wrong answer: it gives ``-inf`` or ``nan`` deep inside an
optimiser, far from the line that caused it. These helpers fail early instead,
with a message that names the offending argument and, where useful, the index.
"""
import math

import numpy as np


def as_positive_array(name: str, values) -> np.ndarray:
    """``values`` as a 1-D float array whose entries are finite and > 0."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty")
    not_finite = np.flatnonzero(~np.isfinite(array))
    if not_finite.size:
        i = not_finite[0]
        raise ValueError(f"{name} contains NaN or inf (first at index {i}: {array[i]}); drop or fix that point")
    not_positive = np.flatnonzero(array <= 0)
    if not_positive.size:
        i = not_positive[0]
        raise ValueError(
            f"{name} must be positive because the fit takes its logarithm; "
            f"got {array[i]} at index {i}"
        )
    return array


def as_positive_number(name: str, value) -> float:
    """``value`` as a float that is finite and > 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return number


def require_same_length(**arrays: np.ndarray) -> int:
    """The common length of ``arrays``; a ValueError listing every length if they differ."""
    lengths = {name: len(array) for name, array in arrays.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(f"mismatched lengths: {listed}; each point needs one value of each")
    return next(iter(lengths.values()))


def require_enough_points(n_points: int, n_parameters: int, what: str) -> None:
    """A fit with more unknowns than observations has no unique answer."""
    if n_points < n_parameters:
        raise ValueError(
            f"{what} has {n_parameters} parameters but got only {n_points} points; "
            f"need at least {n_parameters}"
        )


def require_spread(name: str, values: np.ndarray) -> None:
    """An exponent in ``values`` is unidentifiable if every point has the same value."""
    if np.unique(values).size < 2:
        raise ValueError(f"{name} takes a single value ({values[0]}); the fit needs at least two distinct values")
