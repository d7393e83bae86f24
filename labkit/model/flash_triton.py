"""FlashAttention-2 as Triton kernels: the algorithm of ``labkit/model/flash.py``, compiled for the GPU.

``flash.py`` shows *what* FlashAttention computes, with Python loops over tiles. Here the same loops
become GPU programs. Triton launches one *program* per (query block, batch·head) — the outer loop of
``flash.py`` runs in parallel, one program per streaming multiprocessor slot — and each program runs
the inner loop over key blocks itself. A tile of Q, K and V is loaded from HBM (the GPU's large, slow
memory) into registers/shared memory (small, fast), the scores S = QKᵀ·scale of the tile live only
there, and only the output tile and one log-sum-exp per row go back to HBM. That is the point of the
algorithm: attention is limited by memory traffic, not arithmetic, and the (seq × seq) matrix never
touches HBM.

Three kernels and a preprocess, as in FA2:

* forward, one program per query block: online softmax over the key blocks (running max m, running sum
  l, unnormalised acc rescaled by exp(m_old − m_new)); writes O and L = m + log l per query row.
* backward preprocess: D = rowsum(dO ∘ O), one number per query row.
* dK/dV, one program per key block: loops over the query blocks that can see it and recomputes each tile
  P = exp(S − L). dK and dV of the block stay in registers until the end: no other program writes them.
* dQ, one program per query block: loops over key blocks again. FA2's own code instead adds into dQ
  with atomics from the dK/dV programs; a separate pass recomputes S once more but is simpler and
  deterministic (atomic float adds land in a different order every run).

Causal: a query block visits only key blocks starting at or before its last row (the loop bound stops
at the diagonal), and the dK/dV programs start at the first query block that can see their keys, so
tiles entirely above the diagonal are never loaded. Tiles crossing it, and the ragged last tile when
seq is not a multiple of the block size, are masked element-wise (loads beyond seq read zeros, scores
beyond seq or above the diagonal become −inf, so exp gives exactly 0).

Precision: every accumulator (m, l, acc, dQ, dK, dV, D) is float32. bf16/fp16 inputs feed the tensor
cores directly (``tl.dot`` multiplies in 16 bits and accumulates in 32). float32 inputs use IEEE fp32
dots — exact, to match the float64 reference; TF32 would be faster but keeps only a 10-bit mantissa.

On CPU, ``TRITON_INTERPRET=1`` (set before this module is imported: ``triton.jit`` reads it) runs the
same kernels through Triton's interpreter, in numpy: correct, and slow.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.autograd.function import once_differentiable

try:  # guarded: `import labkit` must work without triton (a ~1 GB package, only in the test extra)
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # the kernels stay plain functions; calling the wrapper explains what to install
    triton = tl = None
    def _jit(fn):
        return fn

HEAD_DIMS = (16, 32, 64, 128)


@_jit
def _fwd_kernel(Q, K, V, O, LSE, scale, seq_len, stride_z, stride_s,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                PRECISION: tl.constexpr):
    start_m, z = tl.program_id(0), tl.program_id(1)
    base = z.to(tl.int64) * stride_z  # int64: batch·heads·seq·dim can pass 2³¹ elements
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + base + offs_m[:, None] * stride_s + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seq_len
    if CAUSAL:  # key blocks after this query block's last row are all masked: never visit them
        hi = tl.minimum((start_m + 1) * BLOCK_M, seq_len)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        kv_off = base + keys[:, None] * stride_s + offs_d[None, :]
        k = tl.load(K + kv_off, mask=keys[:, None] < seq_len, other=0.0)
        v = tl.load(V + kv_off, mask=keys[:, None] < seq_len, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = keys[None, :] < seq_len
        if CAUSAL:
            keep = keep & (keys[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        # Key 0 is in the first block and every row (padding rows too) may see it, so m_new is finite
        # from the first block on: exp(−inf − m_new) = 0 and no row ever computes −inf − (−inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)  # rescale what was summed under the old max (exact)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * stride_s + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + z.to(tl.int64) * seq_len + offs_m, m_i + tl.log(l_i), mask=row_ok)


@_jit
def _bwd_preprocess(O, DO, DELTA, seq_len, stride_z, stride_s, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    start_m, z = tl.program_id(0), tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = z.to(tl.int64) * stride_z + offs_m[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :]
    row_ok = offs_m < seq_len
    o = tl.load(O + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + z.to(tl.int64) * seq_len + offs_m, tl.sum(o * do, 1), mask=row_ok)  # D = rowsum(dO ∘ O)


@_jit
def _query_rows(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d, stride_s, seq_len):
    """One query block's Q and dO tiles with its saved L and D per row (zeros beyond seq_len)."""
    row_ok = offs_m < seq_len
    q_off = base + offs_m[:, None] * stride_s + offs_d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    return q, do, lse, delta


@_jit
def _tile_probs(q, k, lse, offs_m, keys, scale, seq_len, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """P = exp(S − L) for one tile, recomputed from Q, K and the saved log-sum-exp; 0 where masked."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    keep = (offs_m[:, None] < seq_len) & (keys[None, :] < seq_len)
    if CAUSAL:
        keep = keep & (keys[None, :] <= offs_m[:, None])
    return tl.exp(tl.where(keep, s, float("-inf")) - lse[:, None])


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, scale, seq_len, stride_z, stride_s,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    start_n, z = tl.program_id(0), tl.program_id(1)
    base, row_base = z.to(tl.int64) * stride_z, z.to(tl.int64) * seq_len
    keys = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = base + keys[:, None] * stride_s + offs_d[None, :]
    k = tl.load(K + kv_off, mask=keys[:, None] < seq_len, other=0.0)
    v = tl.load(V + kv_off, mask=keys[:, None] < seq_len, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # query blocks that end before this key block's first key cannot see it: skip them
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d, stride_s, seq_len)
        p = _tile_probs(q, k, lse, offs_m, keys, scale, seq_len, CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)        # dV = Pᵀ dO
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                      # dP = dO Vᵀ
        ds = p * (dp - delta[:, None]) * scale      # softmax backward through D, then S's ·scale
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)         # dK = dSᵀ Q
    tl.store(DK + kv_off, dk.to(DK.dtype.element_ty), mask=keys[:, None] < seq_len)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=keys[:, None] < seq_len)


@_jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, scale, seq_len, stride_z, stride_s,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    start_m, z = tl.program_id(0), tl.program_id(1)
    base, row_base = z.to(tl.int64) * stride_z, z.to(tl.int64) * seq_len
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d, stride_s, seq_len)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, seq_len)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kv_off = base + keys[:, None] * stride_s + offs_d[None, :]
        k = tl.load(K + kv_off, mask=keys[:, None] < seq_len, other=0.0)
        v = tl.load(V + kv_off, mask=keys[:, None] < seq_len, other=0.0)
        p = _tile_probs(q, k, lse, offs_m, keys, scale, seq_len, CAUSAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)                    # dQ = dS K
    q_off = base + offs_m[:, None] * stride_s + offs_d[None, :]
    tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=(offs_m < seq_len)[:, None])


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int) -> None:
    if q.dim() < 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"labkit_triton needs q, k, v of one shape (batch, [heads,] seq, head_dim), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"labkit_triton supports head_dim in {HEAD_DIMS} (a power of two: tl.arange and the "
                         f"tensor-core tiles need one), got {q.shape[-1]}; use labkit_flash or sdpa for this shape")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two ≥ 16 (tl.dot's smallest tile), got {block}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or {k.dtype, v.dtype} != {q.dtype}:
        raise ValueError(f"labkit_triton needs q, k, v of one dtype, float32, float16 or bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if triton is None:
        raise RuntimeError("labkit_triton needs the triton package: pip install 'labkit[test]' (Linux), "
                           "or use attention.backend=labkit_flash (the same algorithm in plain PyTorch)")
    if not q.is_cuda and not interpreted():
        raise RuntimeError("labkit_triton runs Triton kernels on a CUDA GPU; on CPU set TRITON_INTERPRET=1 "
                           "(Triton's interpreter: correct but slow) before labkit imports triton, or use "
                           "attention.backend=labkit_flash (the same algorithm in plain PyTorch)")


def _launch_options(head_dim: int) -> dict:
    """Warps per program (4 warps = 128 threads): more for wide heads, whose fp32 accumulators need registers."""
    return {"num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}


def _on(x: torch.Tensor):
    """Launch on x's GPU: Triton launches on the *current* CUDA device, which need not hold x."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class TritonFlashAttentionFunction(torch.autograd.Function):
    """softmax(QKᵀ·scale [causal])·V with Triton kernels, saving only q, k, v, out and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_q: int, block_k: int, scale: float):
        shape, seq, dim = q.shape, q.shape[-2], q.shape[-1]
        q3, k3, v3 = (x.reshape(-1, seq, dim).contiguous() for x in (q, k, v))  # (batch·heads, seq, dim)
        o3 = torch.empty_like(q3)
        lse = torch.empty(q3.shape[:2], device=q.device, dtype=torch.float32)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        grid = (triton.cdiv(seq, block_q), q3.shape[0])
        with _on(q3):
            _fwd_kernel[grid](q3, k3, v3, o3, lse, scale, seq, q3.stride(0), q3.stride(1), CAUSAL=causal,
                              BLOCK_M=block_q, BLOCK_N=block_k, HEAD_DIM=dim, PRECISION=precision,
                              **_launch_options(dim))
        ctx.save_for_backward(q3, k3, v3, o3, lse)
        ctx.config = (shape, causal, block_q, block_k, scale, precision)
        return o3.reshape(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q3, k3, v3, o3, lse = ctx.saved_tensors
        shape, causal, block_q, block_k, scale, precision = ctx.config
        n, seq, dim = q3.shape
        do3 = d_out.reshape(n, seq, dim).to(q3.dtype).contiguous()  # tl.dot wants dO and V in one dtype
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        strides = (q3.stride(0), q3.stride(1))
        common = dict(CAUSAL=causal, BLOCK_M=block_q, BLOCK_N=block_k, HEAD_DIM=dim, PRECISION=precision,
                      **_launch_options(dim))
        with _on(q3):
            _bwd_preprocess[(triton.cdiv(seq, block_q), n)](o3, do3, delta, seq, *strides, BLOCK_M=block_q,
                                                            HEAD_DIM=dim)
            _bwd_dkdv_kernel[(triton.cdiv(seq, block_k), n)](q3, k3, v3, do3, lse, delta, dk, dv, scale, seq,
                                                              *strides, **common)
            _bwd_dq_kernel[(triton.cdiv(seq, block_q), n)](q3, k3, v3, do3, lse, delta, dq, scale, seq,
                                                            *strides, **common)
        return dq.reshape(shape), dk.reshape(shape), dv.reshape(shape), None, None, None, None


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                           block_q: int = 64, block_k: int = 64, scale: float | None = None) -> torch.Tensor:
    """FlashAttention-2 in Triton on (batch, heads, seq, head_dim) or (batch, seq, dim) tensors.

    q, k and v share one shape; head_dim is 16, 32, 64 or 128; ``block_q``/``block_k`` are powers of two
    ≥ 16 (any sequence length works: the last tile is masked). ``scale`` defaults to 1/√head_dim.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    _check(q, k, v, int(block_q), int(block_k))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if interpreted() and q.dtype == torch.bfloat16:
        # numpy has no bfloat16: the interpreter holds bf16 as raw uint16 bits and its tl.dot multiplies
        # those integers. Compute in fp32 instead (autograd casts the gradients back to bf16).
        out = triton_flash_attention(q.float(), k.float(), v.float(), causal, block_q, block_k, scale)
        return out.to(torch.bfloat16)
    return TritonFlashAttentionFunction.apply(q, k, v, bool(causal), int(block_q), int(block_k), scale)


def labkit_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention backend: causal, default tiles, same signature as the others in attention.py."""
    return triton_flash_attention(q, k, v, causal=True)
