"""Ring attention, written to be read (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers").

Each of the cp ranks holds its chunks of the sequence — queries, keys and values (:mod:`.sharding`). Its
queries must meet every rank's keys. Ring attention never gathers them: in cp steps, each rank attends its
queries to the key/value block it holds, and meanwhile passes that block to the next rank round the ring and
receives the previous rank's. After cp − 1 passes every query has met every key block, and each step's
partial result was folded in by log-sum-exp (:mod:`.blocks`: the FlashAttention lab's online softmax, a
level up). Memory per rank: its own chunks, plus one block in flight — never the whole sequence.

    step:        0        1        2        3        (cp = 4: the block rank 0 holds at each step)
    rank 0:    KV0      KV3      KV2      KV1
    rank 1:    KV1      KV0      KV3      KV2         each arrow of the ring moves one block per step,
    rank 2:    KV2      KV1      KV0      KV3         while the block in hand is computed on
    rank 3:    KV3      KV2      KV1      KV0

Under a causal mask a contiguous split leaves rank 0 idle at steps where rank cp − 1 works on every block;
the head-tail layout gives each rank equal work (:func:`.sharding.imbalance`).

**Backward** goes round the ring the same way, carrying each block's key and value gradients with it: at each
step a rank adds its queries' contribution to the block in hand (:func:`.blocks.backward_blocks`, from the
saved log-sum-exp), and passes block and gradients on; after cp steps the gradients arrive home. Bytes per
rank: forward (cp − 1) blocks of K and V, 2·s·d_kv·(cp − 1)/cp of a sequence of s tokens; backward K, V and
their gradients (cp − 1) times plus the gradients' last hop home — a little over twice the forward.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group
from labkit.parallel.cp.blocks import backward_blocks, finish, forward_blocks
from labkit.parallel.cp.sharding import chunk_ids


class RingAttention(torch.autograd.Function):
    """softmax(QKᵀ·scale [causal])·V over the whole sequence, each rank holding (…, local seq, d) of q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: str, causal: bool, timeline: list | None):
        cp, rank = dist.get_world_size(process_group(group)), dist.get_rank(process_group(group))
        scale = 1.0 / math.sqrt(q.shape[-1])
        mine = chunk_ids(rank, cp, layout)
        partials = [None] * len(mine)
        kv = torch.stack([k, v]).contiguous()  # the block that travels: one message a step
        for step in range(cp):
            owner = (rank - step) % cp  # whose keys and values are in hand
            began = time.perf_counter()
            if step < cp - 1:  # pass them on while computing on them
                arriving = torch.empty_like(kv)
                passing = comm.exchange(kv, (rank + 1) % cp, arriving, (rank - 1) % cp, group)
            work = forward_blocks(q, kv[0], kv[1], mine, chunk_ids(owner, cp, layout), causal, scale, partials)
            computed = time.perf_counter()
            if step < cp - 1:
                passing.wait()
                kv = arriving
            if timeline is not None:  # what notebook 12 draws: which block, how long computing, how long waiting
                timeline.append({"step": step, "rank": rank, "block": owner, "work_blocks": work,
                                 "compute_s": computed - began, "wait_s": time.perf_counter() - computed})
        out, lse = finish(partials)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, layout, causal, scale)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale = ctx.args
        cp, rank = dist.get_world_size(process_group(group)), dist.get_rank(process_group(group))
        mine = chunk_ids(rank, cp, layout)
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(dim=-1)  # D = rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]).contiguous(), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(cp):
            owner = (rank - step) % cp
            if step < cp - 1:  # the block itself can travel on now; its gradients once this step has added to them
                kv_next = torch.empty_like(kv)
                passing = comm.exchange(kv, (rank + 1) % cp, kv_next, (rank - 1) % cp, group)
            backward_blocks(q, kv[0], kv[1], d_out, lse, delta, mine, chunk_ids(owner, cp, layout), causal, scale,
                            dq, dkv[0], dkv[1])
            dkv_next = torch.empty_like(dkv)
            comm.exchange(dkv, (rank + 1) % cp, dkv_next, (rank - 1) % cp, group).wait()
            dkv = dkv_next
            if step < cp - 1:
                passing.wait()
                kv = kv_next
        # after cp hops of the gradients, the block in hand is this rank's own, with every rank's contribution
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, layout: str = "head_tail",
                   causal: bool = True, timeline: list | None = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's chunks of it (``layout``), by ring attention over
    ``group`` (the cp axis's :class:`~labkit.comm.axes.AxisGroup`, whose timer counts the bytes sent; a process
    group or None, the world, uncounted). q, k, v: (…, local seq, head dim); returns this rank's rows of the output.
    ``timeline``, a list, gets one entry per forward step: the
    block in hand (its owner rank), the work done on it (chunk × chunk blocks) and the seconds computing and then
    waiting for the next block."""
    return RingAttention.apply(q, k, v, group, layout, causal, timeline)
