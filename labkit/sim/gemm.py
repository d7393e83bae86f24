"""How much of a GPU's matmul rate a layer's GEMMs can use, from their shapes: a *model*, not a measurement.

A GPU computes C = A·B ([M, K] · [K, N]) in output tiles of :data:`TILE` (M × N elements), one thread block per
tile, as many at once as the GPU has streaming multiprocessors (a *wave*). Two things waste part of it:

* **tile quantisation** — a tile that hangs over C's edge computes padding: M = 2,100 costs ⌈2,100 / 128⌉ = 17 tiles
  of 128 rows, as much as 2,176 rows;
* **wave quantisation** — the last wave runs with idle SMs: 120 tiles on 108 SMs take two waves, the second
  with 12 of its 108 SMs busy.

The useful share of a GEMM is M·N / (waves · SMs · tile area) (:func:`wave_share`). And no GEMM runs faster than
its operands stream through memory (a roofline): its time is the larger of FLOPs / (matmul efficiency · peak ·
useful share) and (M·K + K·N + M·N) elements / memory bandwidth (:func:`gemm_seconds`).

:func:`layer_share` adds this up over the GEMMs one micro-batch of a layout runs on one rank — each linear layer's
forward, input-gradient and weight-gradient products, the attention core's batched products, the output layer —
and returns their FLOPs over their time at the full rate: the fraction of ``efficiency × peak`` the step model's
compute runs at (:func:`labkit.sim.step.step_time`). Small hidden sizes, narrow tensor-parallel slices, short
sequences and head dimensions that do not fill a tile lose more; very large GEMMs lose almost nothing.

What is assumed, not fitted: one tile shape for every GEMM (:data:`TILE`, CUTLASS's 128 × 256 bf16 tensor-core
tile on Ampere; cuBLAS picks among several per shape, so this overstates the quantisation of shapes another tile
would fit), every SM running one tile at a time, and the SM count of each GPU (its datasheet, in the catalog:
:attr:`labkit.sim.cluster.GPU.sms`). A GPU with no SM count (a calibrated CPU) has no quantisation: its share is 1
unless memory binds.
The efficiency a full tile reaches (:data:`labkit.sim.step.MATMUL_EFFICIENCY`) stays the step model's one fitted
compute constant: this module adds none.
"""
from __future__ import annotations

import math

TILE = (128, 256)  # (rows of C, columns of C) per thread block: CUTLASS's 128x256x64 bf16 tensor-core tile (Ampere)


def wave_share(m: int, n: int, sms: int | None, tile: tuple[int, int] = TILE, batch: int = 1) -> float:
    """The useful share of ``batch`` GEMMs with [m, n] outputs: m·n·batch over the tile area the waves occupy."""
    if not sms:
        return 1.0
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    waves = math.ceil(tiles / sms)
    return batch * m * n / (waves * sms * tile[0] * tile[1])


def gemm_seconds(m: int, n: int, k: int, rate: float, bandwidth: float, elem: int, sms: int | None,
                 batch: int = 1) -> float:
    """Time of ``batch`` [m, k]·[k, n] products at ``rate`` FLOP/s for a full tile: the slower of the tiles' compute
    and the operands' memory traffic (read both, write the product once)."""
    compute = 2.0 * m * n * k * batch / (rate * wave_share(m, n, sms, batch=batch))
    memory = batch * (m * k + k * n + m * n) * elem / bandwidth
    return max(compute, memory)


def layer_gemms(hidden: int, heads: int, seq: int, micro_batch: int, tp: int,
                cp: int = 1) -> list[tuple[int, int, int, int]]:
    """The (m, n, k, batch) products of one transformer block on one tensor-parallel rank, one micro-batch, forward
    and backward. Each linear layer x[T, K]·W[K, N] runs three (forward [T, N]; input gradient [T, K]; weight
    gradient [K, N], summed over the T tokens); the attention core runs QKᵀ [s, s] and A·V [s, d] per head (batch
    heads/tp · micro_batch) and four products in its backward. With sequence parallelism the linear layers still
    see all T tokens (gathered first), so the shapes are the same. Context parallelism gives a rank T/cp tokens,
    and its q = s/cp queries meet all s keys: QKᵀ [q, s], A·V [q, d]; backward dA [q, s], dV [s, d], dQ [q, d],
    dK [s, d]."""
    t, d, h, q = micro_batch * seq // cp, hidden // heads, hidden, seq // cp
    out = []
    for k, n in ((h, 3 * h // tp), (h // tp, h), (h, 4 * h // tp), (4 * h // tp, h)):  # QKV, proj, fc1, fc2
        out += [(t, n, k, 1), (t, k, n, 1), (k, n, t, 1)]
    b = max(1, micro_batch * heads // tp)
    out += [(q, seq, d, b), (q, d, seq, b)]  # forward: scores QKᵀ, then A·V
    out += [(q, seq, d, b), (seq, d, q, b), (q, d, seq, b), (seq, d, q, b)]  # backward: dA, dV, dQ, dK
    return out


def head_gemms(hidden: int, vocab: int, seq: int, micro_batch: int, tp: int,
               cp: int = 1) -> list[tuple[int, int, int, int]]:
    """The output layer's products (logits [T, V/tp]; its input and weight gradients), T the rank's tokens."""
    t, n = micro_batch * seq // cp, vocab // tp
    return [(t, n, hidden, 1), (t, hidden, n, 1), (hidden, n, t, 1)]


def flops_and_seconds(gemms: list[tuple[int, int, int, int]], rate: float, bandwidth: float, elem: int,
                      sms: int | None) -> tuple[float, float]:
    """The FLOPs of ``gemms`` and their modelled time at ``rate`` (:func:`gemm_seconds`)."""
    return (sum(2.0 * m * n * k * b for m, n, k, b in gemms),
            sum(gemm_seconds(m, n, k, rate, bandwidth, elem, sms, b) for m, n, k, b in gemms))


def layer_share(shape, layout, gpu, elem: int, rate: float) -> float:
    """The fraction of ``rate`` (matmul efficiency × peak) the GEMMs of ``shape`` under ``layout`` run at on ``gpu``,
    in (0, 1]: FLOPs at ``rate`` over modelled time, over the replica's blocks and its output layer (each rank runs
    1/(tp·pp) of them, as the step model spreads them; its seq/cp tokens under context parallelism)."""
    sms, bandwidth, mb, tp, cp = gpu.sms, gpu.memory_bandwidth, layout.micro_batch, layout.tp, layout.cp
    block = flops_and_seconds(layer_gemms(shape.hidden, shape.heads, shape.seq, mb, tp, cp), rate, bandwidth, elem,
                              sms)
    head = flops_and_seconds(head_gemms(shape.hidden, shape.vocab, shape.seq, mb, tp, cp), rate, bandwidth, elem, sms)
    flops, seconds = (shape.layers * b + h for b, h in zip(block, head))
    if seconds <= 0:  # nothing takes time at this rate (a calibration whose fit found no compute cost): no shape effect
        return 1.0
    return flops / rate / seconds
