"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): the activations tensor parallelism leaves whole, split along the sequence.

Tensor parallelism (:mod:`labkit.parallel.tp.layers`) splits the matrices, but between them — the layer
norms, the dropouts, the residual adds — every tp rank still holds the *whole* activation (batch, seq,
n_embd), the same copy on every rank. Those regions are cheap to compute and expensive to keep: per layer
they hold 10·s·b·h of the 34·s·b·h bytes a block saves for backward (the paper's fp16 count, attention
scores aside), and tensor parallelism does not divide them. Sequence parallelism does: in those
regions rank r keeps only tokens ``[r·T/tp, (r+1)·T/tp)``, and the operators that enter and leave the
tensor-parallel region change:

=======================  ===============================  ===============================
operator                 forward                          backward
=======================  ===============================  ===============================
f  (no SP)               identity                         all-reduce
g  (no SP)               all-reduce                       identity
f̄  (SP, before column)   all-gather along the sequence    reduce-scatter along the sequence
ḡ  (SP, after row)       reduce-scatter along sequence    all-gather along the sequence
=======================  ===============================  ===============================

:func:`gather_from_sequence_shards` is f̄ and :func:`reduce_scatter_to_sequence_shards` is ḡ. Since an
all-reduce *is* a reduce-scatter followed by an all-gather, the wire volume is the same as without
sequence parallelism (``labkit.parallel.tp.volume``): the memory saving is free in bytes.

What is saved here, and what is not: the layer norms' inputs, the dropout masks and the residual stream
are kept as sequence shards, but a column-parallel layer's ``F.linear`` keeps the *gathered* input it
needs for its weight gradient (4 of the 10·s·b·h: the q/k/v input and the MLP's, 2·s·b·h each).
Megatron-LM keeps only the shard and all-gathers it again in backward — one more all-gather per column
layer, overlapped with the input-gradient matmul — which is what the paper's (and
``labkit.memory_estimate``'s) s·b·h·34/t assumes. labkit's version keeps the f̄/ḡ table above exact.

**The extra all-reduce.** A parameter *used inside* the sequence-sharded region — the layer norms'
weights and biases, the position embedding, the row-parallel layers' biases (added after ḡ) — is
replicated on every tp rank, but each rank now sees only its tokens, so its gradient is a *partial* sum.
The full gradient is the sum over the tp ranks: :func:`sync_sequence_parallel_grads` all-reduces them
after backward (Megatron-LM's ``_allreduce_layernorm_grads``, in ``finalize_model_grads``). Such parameters carry the
attribute ``sequence_parallel = True`` (:func:`mark_sequence_parallel`), so a trainer can find them.

labkit's activations are (batch, seq, n_embd): the sequence is dimension 1. Megatron's are (seq, batch,
hidden), so its gathers are along dimension 0 and need no copy; here a gather or a scatter along
dimension 1 moves the rank axis in front with one transpose-copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group

SEQUENCE_DIM = 1  # (batch, seq, n_embd)


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(process_group(group)), dist.get_world_size(process_group(group))


def sequence_shard_bounds(seq_len: int, group=None) -> tuple[int, int]:
    """[start, end) of the tokens this rank keeps in the sequence-parallel regions."""
    rank, size = _rank_and_size(group)
    if seq_len % size:
        raise ValueError(f"sequence parallelism splits each sequence across the {size} tensor-parallel ranks: "
                         f"a sequence of {seq_len} tokens does not divide into {size} shards")
    per = seq_len // size
    return rank * per, (rank + 1) * per


def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/p, ...) on each rank → (B, T, ...), the ranks' shards in rank order along the sequence."""
    size = dist.get_world_size(process_group(group))
    stacked = x.new_empty((size * x.shape[0], *x.shape[1:]))  # all_gather concatenates along dim 0
    comm.all_gather(stacked, x.contiguous(), group)
    by_rank = stacked.unflatten(0, (size, x.shape[0]))  # (p, B, T/p, ...): move the rank axis next to T/p
    return by_rank.movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank → this rank's (B, T/p, ...) of their sum."""
    size = dist.get_world_size(process_group(group))
    sequence_shard_bounds(x.shape[SEQUENCE_DIM], group)  # a clear error if T does not divide
    by_rank = x.unflatten(SEQUENCE_DIM, (size, -1)).movedim(SEQUENCE_DIM, 0)  # (p, B, T/p, ...)
    out = x.new_empty(by_rank.shape[1:])
    comm.reduce_scatter(out, by_rank.flatten(0, 1).contiguous(), group)  # split along dim 0
    return out


class _GatherFromSequenceShards(torch.autograd.Function):
    """f̄: all-gather the sequence in forward; reduce-scatter the gradient back to shards in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceShards(torch.autograd.Function):
    """ḡ: sum the partial results and keep this rank's tokens in forward; all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


def gather_from_sequence_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromSequenceShards.apply(x, group)


def reduce_scatter_to_sequence_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceScatterToSequenceShards.apply(x, group)


# ---------------------------------------------------------------- the parameters that need the extra all-reduce

def mark_sequence_parallel(*modules_or_params) -> None:
    """Flag parameters used on sequence shards (``p.sequence_parallel = True``): their gradients are partial
    on each tp rank and :func:`sync_sequence_parallel_grads` sums them. A module flags all its own parameters."""
    for item in modules_or_params:
        params = [item] if isinstance(item, nn.Parameter) else list(item.parameters())
        for p in params:
            p.sequence_parallel = True


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum the partial gradients of the flagged parameters over the tp ranks (one all-reduce of them all,
    flattened). Call it after backward, before clipping and the optimizer (before or after the data-parallel
    sync: both are sums)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP: each dp slice, summed over tp
             for p in sequence_parallel_params(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


class SequenceShardedPositionEmbedding(nn.Embedding):
    """The position embedding of a sequence-parallel model: looks up only this rank's positions, so that it
    adds to the token embedding's sequence shard. Its weight stays whole and replicated (flagged
    ``sequence_parallel``: each rank's gradient has only its positions' rows)."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight)
        self.weight = embedding.weight  # the same parameter, under the same name
        self.group = group
        mark_sequence_parallel(self.weight)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        start, end = sequence_shard_bounds(positions.shape[-1], self.group)
        return F.embedding(positions[..., start:end], self.weight)
