"""Which tokens a context-parallel rank holds, and what causal attention then costs it.

The sequence is cut into equal chunks. **contiguous**: cp chunks, rank r holds chunk r. Under a causal mask the
last rank's queries see the whole sequence and the first rank's almost nothing, so the ranks' work runs 1 : 3 :
5 : … and the slowest sets the pace: max/mean = (2·cp − 1)/cp. **head_tail** (the "zig-zag" split of Megatron
and torchtitan): 2·cp chunks, rank r holds chunk r and chunk 2·cp − 1 − r, one early and one late, so every
rank's two chunks see 2·cp chunks' worth of keys between them: max/mean = 1.

Tensors are (…, seq, dim): a rank's local sequence is its chunks concatenated in the order :func:`chunk_ids`
gives, and :func:`positions` says where each of its tokens sits in the whole sequence.
"""
from __future__ import annotations

import torch

from labkit.parallel.spec import CP_LAYOUTS as LAYOUTS  # parallel.cp.layout's values, declared once there


def n_chunks(cp: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    return cp if layout == "contiguous" else 2 * cp


def chunk_ids(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` of ``cp`` holds, in the order its local sequence keeps them."""
    n_chunks(cp, layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)


def chunk_len(seq_len: int, cp: int, layout: str) -> int:
    n = n_chunks(cp, layout)
    if seq_len % n:
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into {n} equal chunks "
                         f"(cp = {cp}, layout {layout}): use a length divisible by {n}")
    return seq_len // n


def shard(x: torch.Tensor, rank: int, cp: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s part of the whole sequence ``x`` (its chunks along ``dim``, concatenated)."""
    size = chunk_len(x.shape[dim], cp, layout)
    chunks = x.split(size, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, layout)], dim=dim)


def unshard(parts: list[torch.Tensor], layout: str, dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]``: rank r's), in position order."""
    cp = len(parts)
    per_rank = len(chunk_ids(0, cp, layout))
    placed = {}
    for rank, part in enumerate(parts):
        for i, piece in zip(chunk_ids(rank, cp, layout), part.chunk(per_rank, dim=dim)):
            placed[i] = piece
    return torch.cat([placed[i] for i in range(n_chunks(cp, layout))], dim=dim)


def positions(seq_len: int, rank: int, cp: int, layout: str) -> torch.Tensor:
    """The position in the whole sequence of each token rank ``rank`` holds (for the position embedding)."""
    return shard(torch.arange(seq_len)[:, None], rank, cp, layout, dim=0)[:, 0]


def pair_share(q_chunk: int, k_chunk: int, causal: bool) -> float:
    """Of one (query chunk × key chunk) block of scores, the share a causal mask leaves to compute: all of it
    below the diagonal, none above, about half on it (a chunk of L tokens: L(L+1)/2 of L² — counted as ½)."""
    if not causal or k_chunk < q_chunk:
        return 1.0
    return 0.5 if k_chunk == q_chunk else 0.0


def rank_work(rank: int, cp: int, layout: str, causal: bool = True, diagonal: float = 0.5) -> float:
    """Rank ``rank``'s attention work in (chunk × chunk) blocks: its query chunks against every key chunk.
    ``diagonal``: what a block on the diagonal counts — ½ for the scores the mask leaves (the FLOPs a kernel
    that skips masked tiles does), 1 for what :mod:`.blocks` computes (the whole block, then the mask)."""
    shares = (pair_share(q, k, causal) for q in chunk_ids(rank, cp, layout) for k in range(n_chunks(cp, layout)))
    return sum(diagonal if share == 0.5 else share for share in shares)


def imbalance(cp: int, layout: str, causal: bool = True, diagonal: float = 0.5) -> float:
    """max/mean of the ranks' attention work: what the slowest rank costs over a balanced split
    (``diagonal`` as in :func:`rank_work`: ½ gives (2·cp − 1)/cp contiguous; 1 gives 2·cp/(cp + 1))."""
    work = [rank_work(r, cp, layout, causal, diagonal) for r in range(cp)]
    return max(work) / (sum(work) / cp)
