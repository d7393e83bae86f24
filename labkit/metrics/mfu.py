"""Achieved TFLOP/s and MFU, next to nothing else: the definition should be easy to audit."""
from __future__ import annotations

from typing import Optional


def achieved_tflops(flops_per_token: float, tokens: int, seconds: float, devices: int) -> float:
    """Model FLOP/s per device, in TFLOP/s: what the model needed, not what the kernels ran."""
    return flops_per_token * tokens / seconds / devices / 1e12


def mfu(tflops: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Fraction of the device's peak; ``None`` when no honest peak is known."""
    return tflops / peak_tflops if peak_tflops else None
