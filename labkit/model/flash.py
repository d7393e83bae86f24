"""FlashAttention-2 in plain PyTorch: the algorithm, written to be read (Dao, 2023).

Naive attention builds the whole (seq × seq) score matrix S = QKᵀ·scale, turns it into probabilities
P = softmax(S) and multiplies by V. Autograd keeps P for the backward pass, so memory grows as O(n²):
at 4096 tokens and 8 heads that is 512 MiB per matrix, in float32.

FlashAttention never holds S or P whole. It cuts Q into query blocks and K, V into key blocks and
visits one (query block × key block) tile at a time. The obstacle is the softmax, whose denominator
needs every score of a row; the *online softmax* removes it. For each query row keep a running max
``m``, a running sum ``l = Σ exp(s − m)`` and an unnormalised output ``acc = Σ exp(s − m)·v``. When a
new key block raises the max from m_old to m_new, every term already summed is too big by exactly
exp(m_new − m_old), because exp(s − m_new) = exp(s − m_old)·exp(m_old − m_new); multiplying ``l`` and
``acc`` by ``alpha = exp(m_old − m_new)`` (≤ 1, so it cannot overflow) makes them what they would have
been had we known m_new from the start. The rescaling is an identity, not an approximation. After the
last block, out = acc / l.

What FA2 saves for backward: q, k, v, out and one number per query row, the log-sum-exp L = m + log l.
That is O(n). The backward pass *recomputes* each tile of P = exp(QKᵀ·scale − L) instead of storing
it: a second pass of matmuls is cheaper than n² memory (on a GPU, cheaper than reading it from HBM).
It also needs D = rowsum(dO ∘ O), which equals rowsum(dP ∘ P) and so replaces the softmax Jacobian.

Causal attention lets a query see only keys at positions ≤ its own (top-left aligned, like
``scaled_dot_product_attention(is_causal=True)``). Key blocks entirely above the diagonal are skipped
(about half the work); the tiles that straddle it are masked element-wise.

This is a teaching implementation: Python loops over tiles, batched over (batch × heads) with torch
matmuls. It shows the memory behaviour of the real kernel, not its speed.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must have the same number of dims (≥ 2), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"q, k, v must share leading (batch, heads) dims, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same sequence length, got k {tuple(k.shape)} and v {tuple(v.shape)}")


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """(..., seq, dim) → (batch·heads, seq, dim); fp16/bf16 are upcast so that all arithmetic and every
    accumulator (m, l, acc, dQ, dK, dV) is float32 — exp and long sums lose too much in 16-bit floats."""
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x.float() if x.dtype in _LOW_PRECISION else x


def _key_stop(q_stop: int, n_keys: int, causal: bool) -> int:
    """Keys a query block [·, q_stop) can see: causal rows see keys < q_stop; later blocks are skipped."""
    return min(q_stop, n_keys) if causal else n_keys


def _first_query(k_start: int, block_q: int, causal: bool) -> int:
    """First query block that sees key k_start: earlier query blocks lie entirely before it."""
    return (k_start // block_q) * block_q if causal else 0


def _tile_scores(q_blk, k_blk, scale, q_start, k_start, causal) -> torch.Tensor:
    """S = Q Kᵀ·scale for one tile, with −inf where a key comes after the query (causal)."""
    s = (q_blk @ k_blk.transpose(-2, -1)) * scale
    q_last, k_last = q_start + q_blk.shape[-2] - 1, k_start + k_blk.shape[-2] - 1
    if causal and k_last > q_start:  # the tile straddles the diagonal: mask element-wise
        rows = torch.arange(q_start, q_last + 1, device=s.device)[:, None]
        cols = torch.arange(k_start, k_last + 1, device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _online_softmax_update(m, l, acc, s, v_blk):
    """Fold one tile of scores into the running (max m, sum l, output acc) of each query row."""
    m_new = torch.maximum(m, s.amax(dim=-1))
    m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that has seen no key yet
    alpha = torch.exp(m - m_safe)            # rescale what was summed under the old max (exact)
    p = torch.exp(s - m_safe[..., None])     # masked scores: exp(−inf) = 0
    l = alpha * l + p.sum(dim=-1)
    acc = alpha[..., None] * acc + p @ v_blk
    return m_new, l, acc


def _forward(q, k, v, causal, block_q, block_k, scale):
    """Tiled forward on (N, seq, dim) tensors (fp32 or fp64) → (out, lse) in that dtype."""
    n, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    out = q.new_empty(n, n_q, v.shape[-1])
    lse = q.new_empty(n, n_q)
    for q0 in range(0, n_q, block_q):
        q_blk = q[:, q0:q0 + block_q]
        rows = q_blk.shape[-2]
        m = q.new_full((n, rows), float("-inf"))
        l = q.new_zeros(n, rows)
        acc = q.new_zeros(n, rows, v.shape[-1])
        for k0 in range(0, _key_stop(q0 + rows, n_k, causal), block_k):
            s = _tile_scores(q_blk, k[:, k0:k0 + block_k], scale, q0, k0, causal)
            m, l, acc = _online_softmax_update(m, l, acc, s, v[:, k0:k0 + block_k])
        out[:, q0:q0 + rows] = acc / l[..., None]
        lse[:, q0:q0 + rows] = m + torch.log(l)
    return out, lse


def _backward(q, k, v, out, lse, d_out, causal, block_q, block_k, scale):
    """Recompute each tile of P from L and accumulate dQ, dK, dV ((N, seq, dim), fp32 or fp64)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = (d_out * out).sum(dim=-1)  # D = rowsum(dO ∘ O) = rowsum(dP ∘ P)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for k0 in range(0, n_k, block_k):  # outer loop over key blocks: dK, dV of this block stay local
        k_blk, v_blk = k[:, k0:k0 + block_k], v[:, k0:k0 + block_k]
        dk_blk, dv_blk = torch.zeros_like(k_blk), torch.zeros_like(v_blk)
        for q0 in range(_first_query(k0, block_q, causal), n_q, block_q):
            q_sl = slice(q0, q0 + block_q)
            q_blk, do_blk = q[:, q_sl], d_out[:, q_sl]
            s = _tile_scores(q_blk, k_blk, scale, q0, k0, causal)
            p = torch.exp(s - lse[:, q_sl, None])          # the softmax tile, recomputed
            dv_blk += p.transpose(-2, -1) @ do_blk
            dp = do_blk @ v_blk.transpose(-2, -1)
            ds = p * (dp - delta[:, q_sl, None]) * scale     # softmax backward via D, then S's ·scale
            dq[:, q_sl] += ds @ k_blk
            dk_blk += ds.transpose(-2, -1) @ q_blk
        dk[:, k0:k0 + block_k], dv[:, k0:k0 + block_k] = dk_blk, dv_blk
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """softmax(QKᵀ·scale [causal])·V, saving only q, k, v, out and the per-row log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_q: int, block_k: int, scale: float):
        out, lse = _forward(_as_3d(q), _as_3d(k), _as_3d(v), causal, block_q, block_k, scale)
        out = out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, block_q, block_k, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_as_3d(q), _as_3d(k), _as_3d(v), _as_3d(out), lse,
                               _as_3d(d_out), *ctx.config)
        grads = (g.to(x.dtype).reshape(x.shape) for g, x in ((dq, q), (dk, k), (dv, v)))
        return (*grads, None, None, None, None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block_q: int = 128, block_k: int = 128, scale: float | None = None) -> torch.Tensor:
    """FlashAttention-2 on (..., seq, head_dim) tensors: (B, S, D), (B, H, S, D), any leading dims.

    ``block_q``/``block_k`` are the tile sizes (any sequence length works: the last tile is short). The
    default 128 × 128 keeps each tile's scores at 64 KiB per (batch·head) — memory still O(n) — and
    makes fewer, larger matmuls than 64 × 64, so less time goes to Python between them (measured against
    sdpa with both tile sizes: ``benchmarks/results/attention.jsonl``, table ``tiles``).
    ``scale`` defaults to 1/√head_dim. fp16/bf16 inputs are computed in fp32 and returned in their dtype.
    """
    _check_shapes(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tile sizes must be ≥ 1, got block_q={block_q}, block_k={block_k}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return FlashAttentionFunction.apply(q, k, v, bool(causal), int(block_q), int(block_k), scale)


def labkit_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention backend: causal, default tiles, same signature as the others in attention.py."""
    return flash_attention(q, k, v, causal=True)


def online_softmax_steps(scores_row: torch.Tensor, block: int) -> list[dict]:
    """The online softmax of ONE row of scores, one block at a time, for showing step by step.

    Returns one dict per block: ``start``/``stop`` (the block), ``max`` (running m), ``sum`` (running
    l), ``rescale`` (alpha = exp(m_old − m_new) applied to what came before) and ``probs``: the row's
    softmax as known so far, exp(s − m)/l on the scores seen and 0 on the rest. The last ``probs``
    equals ``torch.softmax(scores_row, -1)``; the running max never decreases.
    """
    if scores_row.dim() != 1 or scores_row.numel() == 0:
        raise ValueError(f"scores_row must be a non-empty 1-D tensor, got shape {tuple(scores_row.shape)}")
    if block < 1:
        raise ValueError(f"block must be ≥ 1, got {block}")
    s = scores_row.detach().double()
    numer = torch.zeros_like(s)  # exp(s − m) for the scores seen so far, 0 for the rest
    m, l, steps = float("-inf"), 0.0, []
    for start in range(0, s.numel(), block):
        stop = min(start + block, s.numel())
        m_new = max(m, s[start:stop].max().item())
        alpha = math.exp(m - m_new) if m != float("-inf") else 0.0
        numer[:start] *= alpha                      # old terms, as if m_new had been known from the start
        numer[start:stop] = torch.exp(s[start:stop] - m_new)
        l = alpha * l + numer[start:stop].sum().item()
        m = m_new
        steps.append({"start": start, "stop": stop, "max": m, "sum": l, "rescale": alpha,
                      "probs": (numer / l).to(scores_row.dtype)})
    return steps
