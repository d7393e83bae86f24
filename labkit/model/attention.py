"""Attention backends: one function each, chosen by ``attention.backend``.

Every backend computes the same thing, causal softmax(QKᵀ/√d)·V on tensors shaped
(batch, heads, seq, head_dim); they differ in how much memory and time it costs.
``naive`` materialises the (seq × seq) score matrix — easy to read, O(T²) memory.
``sdpa`` hands the work to ``torch.nn.functional.scaled_dot_product_attention``, which picks a
fused kernel (FlashAttention on recent GPUs, a flash-style kernel on CPU). ``labkit_flash`` is
FlashAttention-2 written out in PyTorch (``labkit/model/flash.py``): tiles and an online softmax,
exact attention without ever holding the (seq × seq) matrix.
Adding a backend means adding a function and one line in ``ATTENTION_BACKENDS``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    seq = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def labkit_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from labkit.model.flash import labkit_flash_attention

    return labkit_flash_attention(q, k, v)


ATTENTION_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "labkit_flash": labkit_flash,
}


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Which fused kernel ``scaled_dot_product_attention`` picks for tensors like these (causal)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True)).name
    except (AttributeError, RuntimeError, ValueError):  # a private API: report honestly when it is gone
        return "unknown"


def describe_kernel(name: str, q: torch.Tensor) -> str:
    """What actually runs for backend ``name`` on queries like ``q``: e.g. "sdpa → FLASH_ATTENTION"."""
    return f"sdpa → {sdpa_kernel(q, q, q)}" if name == "sdpa" else name


def get_attention(name: str):
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}") from None
