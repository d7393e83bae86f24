"""Attention backends: one function each, chosen by ``attention.backend``.

Every backend computes the same thing, causal softmax(QKᵀ/√d)·V on tensors shaped
(batch, heads, seq, head_dim); they differ in how much memory and time it costs.
``naive`` materialises the (seq × seq) score matrix — easy to read, O(T²) memory.
``sdpa`` hands the work to ``torch.nn.functional.scaled_dot_product_attention``, which picks a
fused kernel (FlashAttention on recent GPUs, a flash-style kernel on CPU). ``labkit_flash`` is
FlashAttention-2 written out in PyTorch (``labkit/model/flash.py``): tiles and an online softmax,
exact attention without ever holding the (seq × seq) matrix. ``labkit_triton`` is the same algorithm as
Triton GPU kernels (``labkit/model/flash_triton.py``; on CPU only under ``TRITON_INTERPRET=1``), and
``flash_attn`` calls Tri Dao's flash-attn package (CUDA only). The last two cannot run everywhere:
``backend_unavailable`` says why, and ``labkit.validation.validate`` reports it before a run starts.
Adding a backend means adding a function and one line in ``ATTENTION_BACKENDS``.
"""
from __future__ import annotations

import functools
import importlib
import math
import os
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


def labkit_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from labkit.model.flash_triton import labkit_triton_attention

    return labkit_triton_attention(q, k, v)


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``flash_attn.flash_attn_func``: FlashAttention-2's own CUDA kernels (fp16/bf16 only, CUDA only).

    flash-attn wants (batch, seq, heads, head_dim), labkit uses (batch, heads, seq, head_dim): transpose
    in and out (views: the kernel takes any batch/seq/head strides as long as head_dim is contiguous).
    It has no fp32 kernel, so fp32 inputs (precision.mode=fp32) are cast to bf16 for attention alone and
    the output back to fp32: about 3 significant digits inside attention, fp32 everywhere else.
    """
    problem = backend_unavailable("flash_attn", q.device.type)
    if problem:
        raise RuntimeError(f"attention backend flash_attn: {problem}")
    if q.dim() != 4:
        raise ValueError(f"flash_attn takes (batch, heads, seq, head_dim) tensors, got q {tuple(q.shape)}")
    from flash_attn import flash_attn_func

    low = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    out = flash_attn_func(*(x.transpose(1, 2).to(low) for x in (q, k, v)), causal=True)
    return out.transpose(1, 2).to(q.dtype)


@functools.cache
def _import_problem(module: str) -> str | None:
    """None if ``module`` imports, else why not (missing, or e.g. built against another torch)."""
    try:
        importlib.import_module(module)
    # any error: an ImportError, or e.g. an OSError from a compiled extension that does not load
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return None


def backend_unavailable(name: str, device: str) -> str | None:
    """Why attention backend ``name`` cannot run on ``device`` ("cpu" or "cuda") here, or None if it can."""
    on_gpu = device == "cuda" and torch.cuda.is_available()
    if name == "flash_attn":
        instead = ("use attention.backend=sdpa (torch's fused kernel: FlashAttention-2 inside on recent GPUs), "
                   "labkit_flash, or auto")
        if not on_gpu:
            return ("the flash-attn package runs on NVIDIA GPUs only, and this run has no CUDA GPU (on a CUDA "
                    f"machine, get it with `pip install labkit[gpu]`); {instead}")
        if _import_problem("flash_attn"):
            return (f"the flash-attn package does not import ({_import_problem('flash_attn')}); install it "
                    f"with `pip install labkit[gpu]` on this CUDA machine, or {instead}")
    if name == "labkit_triton":
        if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            return ("runs Triton kernels on a CUDA GPU, and this run has none; on CPU set TRITON_INTERPRET=1 "
                    "(Triton's interpreter: correct but slow) or use attention.backend=labkit_flash")
        if _import_problem("triton"):
            return (f"needs the triton package ({_import_problem('triton')}): `pip install labkit[test]` "
                    "(Linux), or use attention.backend=labkit_flash, the same algorithm in plain PyTorch")
    return None


ATTENTION_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "labkit_flash": labkit_flash,
    "labkit_triton": labkit_triton,
    "flash_attn": flash_attn_attention,
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


def attention_problems(backend: str, device: str) -> list[str]:
    """``attention.backend``'s problem on this run's device (see :func:`backend_unavailable`), for validation."""
    problem = backend_unavailable(backend, device)
    return [f"attention.backend={backend}: {problem}"] if problem else []


def attention_costs(seqs: list[int], backends: list[str] | None = None, heads: int = 8, head_dim: int = 64,
                    repeats: int = 2) -> list[dict]:
    """Forward+backward time (best of ``repeats``) and bytes saved for backward, per backend and length."""
    import time

    from labkit.metrics.memory import count_saved_bytes

    rows = []
    # by default the backends that run on any CPU: labkit_triton and flash_attn are CUDA kernels
    for backend in backends or ["naive", "sdpa", "labkit_flash"]:
        attend = ATTENTION_BACKENDS[backend]
        for seq in seqs:
            q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                with count_saved_bytes() as saved:
                    out = attend(q, k, v)
                out.sum().backward()
                best = min(best, time.perf_counter() - start)
            rows.append({"backend": backend, "seq": seq, "time_s": best, "saved_bytes": saved.total})
    return rows
