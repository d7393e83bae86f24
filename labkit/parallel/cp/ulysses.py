"""Ulysses context parallelism (DeepSpeed-Ulysses: Jacobs et al. 2023).

Attention mixes tokens but not heads. So instead of passing keys round, Ulysses re-shards: an all-to-all turns
"every rank has all heads of its tokens" into "every rank has all tokens of its heads" (heads ÷ cp each), plain
attention runs on whole sequences, and a second all-to-all turns the output back. Each all-to-all moves
(cp − 1)/cp of a rank's tensor: q, k and v in, the output back, about (2·h + 2·h_kv)·d·s/cp bytes per rank
each way — independent of cp in total, where the ring's grows with it. The price: cp must divide the heads
(it refuses otherwise), and the all-to-all crosses every rank of the group at once, so it wants a fast one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group
from labkit.parallel.cp.blocks import BlockAttention
from labkit.parallel.cp.sharding import chunk_ids


class AllToAll(torch.autograd.Function):
    """(cp, …): chunk j to rank j, chunk j of the result from rank j. Its own adjoint: backward is one more."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # dim 0 outermost in memory: chunk j is one run of bytes
        out = torch.empty_like(x)
        comm.all_to_all(out, x, group)
        return out

    @staticmethod
    def backward(ctx, d_out):
        group = ctx.group
        d_out = d_out.contiguous()
        d_x = torch.empty_like(d_out)
        comm.all_to_all(d_x, d_out, group)
        return d_x, None


def heads_problem(n_head: int, cp: int) -> str | None:
    if n_head % cp:
        return (f"Ulysses gives each of the cp = {cp} ranks n_head / cp heads, and {n_head} heads do not divide "
                f"by {cp}: use a cp that divides {n_head}, or the ring or all-gather variant")
    return None


def to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, local seq, d) → (B, H/cp, every rank's seq, d): this rank's head group, all tokens (rank order)."""
    cp = dist.get_world_size(process_group(group))
    by_rank = x.unflatten(1, (cp, x.shape[1] // cp)).movedim(1, 0)  # (cp, B, H/cp, s, d): head group j → rank j
    return AllToAll.apply(by_rank, group).movedim(0, 2).flatten(2, 3)


def to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`to_heads`: (B, H/cp, every rank's seq, d) → (B, H, local seq, d)."""
    cp = dist.get_world_size(process_group(group))
    by_rank = y.unflatten(2, (cp, y.shape[2] // cp)).movedim(2, 0)  # (cp, B, H/cp, s, d): rank j's tokens → j
    return AllToAll.apply(by_rank, group).movedim(0, 1).flatten(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, layout: str = "head_tail",
                      causal: bool = True) -> torch.Tensor:
    """Attention over the whole sequence from this rank's chunks of it, by re-sharding heads (q, k, v: (B, H,
    local seq, d), H divisible by cp). Arguments as ring_attention's."""
    cp = dist.get_world_size(process_group(group))
    problem = heads_problem(q.shape[1], cp)
    if problem:
        raise ValueError(problem)
    qh, kh, vh = (to_heads(t, group) for t in (q, k, v))
    every = [c for r in range(cp) for c in chunk_ids(r, cp, layout)]  # the chunks in the order they arrived
    return to_sequence(BlockAttention.apply(qh, kh, vh, every, every, causal), group)
