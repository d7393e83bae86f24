"""The whole GPT split by tensor parallelism: vocabulary-parallel embedding, output layer and loss.

:mod:`labkit.parallel.tp.layers` splits a transformer block's matrices. What is left of a GPT are the
token embedding and the output layer that shares its weight, each a vocabulary × width matrix — for a
real vocabulary the largest matrices of the model — and both are split by vocabulary rows:

* :class:`VocabParallelEmbedding`: each rank looks up the ids it owns, the others contribute zeros, and
  ``g`` sums the ranks' rows;
* :class:`VocabParallelHead`: each rank computes the logits of its slice of the vocabulary (f in front);
* :func:`vocab_parallel_cross_entropy`: the loss from each rank's slice of the logits with three
  all-reduces of one number per token (the max, the target's logit, the sum of exponentials), never
  gathering a full-vocabulary row.

:func:`parallelize_gpt` puts it together for a whole model or for one pipeline stage of it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import collectives as comm
from labkit.parallel.tp.sequence import SequenceShardedPositionEmbedding, mark_sequence_parallel
from labkit.parallel.tp.layers import enter_tp, leave_tp, parallelize_block, shard_range, tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ``vocab / tp`` rows; ids it does not own look up zeros, and g sums the ranks' rows
    (ḡ with ``sequence_parallel``: the sum, this rank's tokens only)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.start, self.end = shard_range(num_embeddings, group)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, sequence_parallel: bool = False):
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start:layer.end])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return leave_tp(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group, self.sequence_parallel)


# ---------------------------------------------------------------- the loss, from vocabulary slices

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary: per token, three all-reduces of one number each."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        comm.all_reduce(local_max, group, dist.ReduceOp.MAX)  # the softmax's shift, exact
        shifted = logits - local_max.unsqueeze(-1)
        vocab = logits.shape[-1]
        owned = (target >= vocab_start) & (target < vocab_start + vocab)
        index = (target - vocab_start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        comm.all_reduce(target_logit, group)  # only the owner's is nonzero
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, owned)  # this rank's softmax slice
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, index.unsqueeze(-1), owned.unsqueeze(-1).to(softmax.dtype))
        count = softmax.numel() // softmax.shape[-1]
        return (softmax - onehot) * (grad / count), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 group=None) -> torch.Tensor:
    """``F.cross_entropy`` (mean over tokens) of the full logits, from this rank's vocabulary slice
    ``[vocab_start, vocab_start + logits_shard.shape[-1])``; the full row is never gathered."""
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_start)


# ---------------------------------------------------------------- the whole GPT

class VocabParallelHead(nn.Module):
    """The tied output layer split by vocabulary: this rank's slice of the logits, from the embedding's rows,
    for the whole sequence (with ``sequence_parallel`` the shards are gathered first, f̄)."""

    def __init__(self, embedding: VocabParallelEmbedding, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.weight = embedding.weight  # tied, as in the full model: one parameter, one gradient
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_tp(x, self.group, self.sequence_parallel), self.weight)


class VocabParallelCrossEntropy(nn.Module):
    """``labkit.model.gpt.CrossEntropy`` from vocabulary slices (:func:`vocab_parallel_cross_entropy`)."""

    def __init__(self, vocab_start: int, group=None):
        super().__init__()
        self.vocab_start, self.group = vocab_start, group

    def forward(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, targets, self.vocab_start, self.group)


def parallelize_gpt(model, group=None, sequence_parallel: bool = False, make_real=None):
    """Megatron's layout of a whole ``labkit.model.gpt.GPT``, in place: the embedding and the tied output
    layer by vocabulary, every block by heads and MLP columns, the loss from vocabulary slices. Position
    embeddings and layer norms stay replicated. The model then returns this rank's slice of the logits
    (and the full loss). Every rank must pass the same full weights (same seed): each keeps its slices.

    With ``sequence_parallel`` the embedding's output is reduce-scattered to sequence shards (each rank
    adds its positions' embeddings), the blocks run their norms and residuals on shards, and the head
    gathers the sequence back before the output layer, so the loss is computed as without it — from
    vocabulary slices of the whole sequence, whose softmax needs every vocabulary slice of a token on
    the same rank, and a sequence shard would instead need the whole vocabulary. The trainer must call
    :func:`~labkit.parallel.tp.sequence.sync_sequence_parallel_grads` after backward.
    Needs ``block_size`` divisible by the tp degree.

    A model built on the meta device passes ``make_real(unit, name)`` (:func:`labkit.parallel.parallelize.part_maker`):
    each unit (the embedding, a block, an untied head) is made real just before it is sliced, so a rank never
    holds more than one whole unit beside its slices."""
    if sequence_parallel and model.shape.block_size % tp_rank_and_size(group)[1]:
        raise ValueError(f"sequence parallelism splits each sequence across the tp ranks: block_size "
                         f"{model.shape.block_size} is not divisible by the tp degree {tp_rank_and_size(group)[1]}")
    embeds, heads = hasattr(model, "wte"), hasattr(model, "lm_head")  # a pipeline stage may hold neither
    tied = embeds and heads and model.lm_head.weight is model.wte.weight
    make_real = make_real or (lambda unit, name: None)
    if sequence_parallel and embeds:
        model.wpe = SequenceShardedPositionEmbedding(model.wpe, group)
    if sequence_parallel and heads:
        mark_sequence_parallel(model.ln_f)
    if embeds:
        make_real(model.wte, "wte")
        model.wte = VocabParallelEmbedding.from_embedding(model.wte, group, sequence_parallel)
    for index, block in enumerate(model.blocks):
        make_real(block, f"blocks.{index}")
        parallelize_block(block, group, sequence_parallel)
    if heads:  # the last pipeline stage's head is its own copy of the embedding: sliced the same way
        if not tied:
            make_real(model.lm_head, "lm_head")
        rows = model.wte if tied else VocabParallelEmbedding.from_embedding(
            nn.Embedding.from_pretrained(model.lm_head.weight.detach(), freeze=False), group)
        model.lm_head = VocabParallelHead(rows, group, sequence_parallel)
        model.criterion = VocabParallelCrossEntropy(rows.start, group)
    return model
