"""Precision modes, chosen by ``precision.mode``.

Weights, gradients and optimizer state stay fp32 ("master weights"); only the forward and
backward math runs in lower precision under ``torch.autocast``. bf16 keeps fp32's exponent
range, so it needs no loss scaling; fp16 has a narrow range, so small gradients underflow to
zero unless the loss is scaled up first (``GradScaler``) — which is why fp16 needs a scaler.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Precision:
    mode: str
    device: str
    scaler: Optional[torch.amp.GradScaler] = None

    @property
    def peak_dtype(self) -> str:
        """Which column of the peak table MFU is measured against."""
        if self.mode == "fp32" and self.device == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return self.mode

    def autocast(self):
        if self.mode == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.mode == "bf16" else torch.float16
        return torch.autocast(device_type=self.device, dtype=dtype)


def build_precision(cfg, device: str) -> Precision:
    mode = cfg.precision.mode
    if mode == "fp16" and device != "cuda":
        raise ValueError("precision.mode=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")
    scaler = torch.amp.GradScaler(device) if mode == "fp16" else None
    return Precision(mode=mode, device=device, scaler=scaler)
