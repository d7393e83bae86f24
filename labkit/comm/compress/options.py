"""Checks for compressor options: each error names the option, the value and the fix."""
from __future__ import annotations


def ratio_problems(cfg) -> list[str]:
    """``comm.compression_ratio``, read by the sparsifiers (topk, randomk): checked before any worker starts."""
    ratio = cfg.comm.compression_ratio
    if not 0 < ratio <= 1:
        return [f"comm.compression_ratio: the fraction of entries sent must be in (0, 1], got {ratio}; 0.01 keeps 1%"]
    return []


def require_fraction(owner: str, key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{owner}: {key}={value!r} must be a fraction in (0, 1] of the entries to send; "
                         f"e.g. {key}=0.01 sends 1%")


def require_int(owner: str, key: str, value, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {key}={value!r} must be an integer >= {minimum}{hint}")


def require_bool(owner: str, key: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {key}={value!r} must be True or False")
