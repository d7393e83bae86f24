"""The block arithmetic the context-parallel variants share: a rank's query chunks against some key/value chunks.

A rank's queries are its chunks of the sequence; keys and values arrive a chunk set at a time (round a ring,
or all at once). Attention over all keys is softmax(S)·V with S = QKᵀ·scale, and the softmax needs every key
of a row. It splits exactly over key blocks all the same — the online softmax of the FlashAttention lab
(``labkit.model.flash``), one level up: each block b gives its own normalised output O_b and its row
log-sum-exp L_b = log Σ exp(S_b), and two partials merge into the pair's own result,

    L = log(exp L_a + exp L_b),    O = exp(L_a − L)·O_a + exp(L_b − L)·O_b.

Drop the exp(L_b − L) factor, or merge unnormalised outputs, and the forward looks plausible and is wrong:
the gradient check in the tests is what catches it (notebook 12's bug zoo turns such mistakes on).

Backward needs only the final L and D = rowsum(dO ∘ O) of each query row: every block's probabilities are
recomputed as P = exp(S − L), and then dV += Pᵀ·dO, dS = P ∘ (dO·Vᵀ − D)·scale, dQ += dS·K, dK += dSᵀ·Q.
So a variant that has every key it needs in hand (all-gather KV, Ulysses) runs :class:`BlockAttention`: it keeps
q, k, v, the output and L for backward — never a block's probabilities, as a fused kernel keeps none.

A causal mask works on chunks (:func:`labkit.parallel.cp.sharding.pair_share`): a key chunk after the query
chunk is skipped, one before it is computed whole, and on the diagonal the upper triangle is masked.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from labkit.parallel.cp.sharding import pair_share

Partial = Optional[tuple[torch.Tensor, torch.Tensor]]  # (out, lse) of one query chunk so far; None: no key yet


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """S = Q·Kᵀ·scale of one chunk pair, the future masked out (−inf) on the diagonal."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def merge(partial: Partial, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into a query chunk's partial: exact, by log-sum-exp."""
    if partial is None:
        return out, lse
    out_a, lse_a = partial
    total = torch.logaddexp(lse_a, lse)
    return out_a * torch.exp(lse_a - total)[..., None] + out * torch.exp(lse - total)[..., None], total


def forward_blocks(q, k, v, q_ids, k_ids, causal: bool, scale: float, partials: list[Partial]) -> float:
    """Fold key/value chunks ``k_ids`` (``k``, ``v``: those chunks concatenated) into ``partials`` (one per
    query chunk of ``q``, in ``q_ids`` order), in place. Returns the work done, in chunk × chunk blocks."""
    work = 0.0
    for i, (q_id, q_c) in enumerate(zip(q_ids, q.chunk(len(q_ids), dim=-2))):
        for k_id, k_c, v_c in zip(k_ids, k.chunk(len(k_ids), dim=-2), v.chunk(len(k_ids), dim=-2)):
            share = pair_share(q_id, k_id, causal)
            if share == 0:
                continue
            s = scores(q_c, k_c, scale, diagonal=share < 1)
            lse = torch.logsumexp(s, dim=-1)
            partials[i] = merge(partials[i], torch.exp(s - lse[..., None]) @ v_c, lse)
            work += share
    return work


def finish(partials: list[Partial]) -> tuple[torch.Tensor, torch.Tensor]:
    """The query chunks' outputs and log-sum-exps, concatenated back into the rank's local sequence."""
    if any(p is None for p in partials):
        raise RuntimeError("a query chunk saw no key: every chunk must at least meet its own keys")
    return torch.cat([p[0] for p in partials], dim=-2), torch.cat([p[1] for p in partials], dim=-1)


class BlockAttention(torch.autograd.Function):
    """Query chunks ``q_ids`` of ``q`` attending to key/value chunks ``k_ids`` of ``k``, ``v``, all in hand: the
    forward folds every block by log-sum-exp, the backward recomputes each block's probabilities from L."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids: list[int], k_ids: list[int], causal: bool):
        scale = 1.0 / math.sqrt(q.shape[-1])  # as the ring's
        partials: list[Partial] = [None] * len(q_ids)
        forward_blocks(q, k, v, q_ids, k_ids, causal, scale, partials)
        out, lse = finish(partials)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_ids, k_ids, causal, scale)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        q_ids, k_ids, causal, scale = ctx.args
        d_out = d_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        backward_blocks(q, k, v, d_out, lse, (d_out * out).sum(dim=-1), q_ids, k_ids, causal, scale, dq, dk, dv)
        return dq, dk, dv, None, None, None


def backward_blocks(q, k, v, d_out, lse, delta, q_ids, k_ids, causal: bool, scale: float, dq, dk, dv) -> None:
    """Add one (query chunks × key chunks) block's gradients into ``dq`` (the queries') and ``dk``, ``dv`` (these
    keys' and values'), in place; ``lse`` and ``delta`` = rowsum(dO ∘ O) are the queries' final ones."""
    n_q, n_k = len(q_ids), len(k_ids)
    q_parts = zip(q_ids, q.chunk(n_q, -2), d_out.chunk(n_q, -2), lse.chunk(n_q, -1), delta.chunk(n_q, -1),
                  dq.chunk(n_q, -2))
    for q_id, q_c, do_c, lse_c, delta_c, dq_c in q_parts:
        k_parts = zip(k_ids, k.chunk(n_k, -2), v.chunk(n_k, -2), dk.chunk(n_k, -2), dv.chunk(n_k, -2))
        for k_id, k_c, v_c, dk_c, dv_c in k_parts:
            share = pair_share(q_id, k_id, causal)
            if share == 0:
                continue
            p = torch.exp(scores(q_c, k_c, scale, diagonal=share < 1) - lse_c[..., None])  # recomputed
            dv_c += p.transpose(-2, -1) @ do_c
            ds = p * (do_c @ v_c.transpose(-2, -1) - delta_c[..., None]) * scale
            dq_c += ds @ k_c
            dk_c += ds.transpose(-2, -1) @ q_c
