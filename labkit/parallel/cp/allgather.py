"""All-gather KV context parallelism (Llama 3's choice: Dubey et al. 2024, §3.3.2).

Ring attention hides each block's transfer behind the block before it, at the price of cp small messages and a
careful schedule. Llama 3 gathers instead: one all-gather gives every rank the whole sequence's keys and values
(they are small beside the queries when heads share them, as in grouped-query attention), each rank attends
its own query chunks to all of them, and in backward one reduce-scatter sends every key and value gradient home.
Same bytes as the ring (2·s·d_kv·(cp − 1)/cp each way), two collectives instead of 2·cp messages, nothing to
overlap unless the next layer's gather is started early — and memory for the whole K and V: kept for backward
(:class:`~labkit.parallel.cp.blocks.BlockAttention`), cp times a rank's own, in every layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group
from labkit.parallel.cp.blocks import BlockAttention
from labkit.parallel.cp.sharding import chunk_ids


class GatherKV(torch.autograd.Function):
    """(2, …, local seq, d) of k and v on each rank → (cp, 2, …) of every rank's; backward: reduce-scatter home."""

    @staticmethod
    def forward(ctx, kv, group):
        cp = dist.get_world_size(process_group(group))
        gathered = kv.new_empty(cp * kv.shape[0], *kv.shape[1:])  # concatenated in rank order, as gloo wants it
        comm.all_gather(gathered, kv.contiguous(), group)
        ctx.group = group
        return gathered.view(cp, *kv.shape)

    @staticmethod
    def backward(ctx, d_gathered):
        group = ctx.group
        d_kv = d_gathered.new_empty(d_gathered.shape[1:])
        # summed: every rank's queries
        comm.reduce_scatter(d_kv, d_gathered.flatten(0, 1).contiguous(), group)
        return d_kv, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, layout: str = "head_tail",
                        causal: bool = True) -> torch.Tensor:
    """Attention over the whole sequence from this rank's chunks of it: gather every rank's keys and values, attend
    this rank's query chunks to them (:class:`.blocks.BlockAttention`). Arguments as ring_attention's."""
    cp, rank = dist.get_world_size(process_group(group)), dist.get_rank(process_group(group))
    gathered = GatherKV.apply(torch.stack([k, v]), group)
    keys = torch.cat(list(gathered[:, 0]), dim=-2)  # every rank's chunks, in rank order
    values = torch.cat(list(gathered[:, 1]), dim=-2)
    every = [c for r in range(cp) for c in chunk_ids(r, cp, layout)]
    return BlockAttention.apply(q, keys, values, chunk_ids(rank, cp, layout), every, causal)
