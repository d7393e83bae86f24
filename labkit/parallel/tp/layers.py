"""Tensor parallelism written out (Megatron-LM, Shoeybi et al. 2019): one layer's matrices split across ranks.

Data parallelism copies the whole model to every rank. When one layer no longer fits — or one GPU is too
slow for it — the *matrices* are split instead, over the ``tp`` axis of the rank grid
(``labkit.parallel.mesh``), and the ranks compute one layer together.

A linear layer ``Y = X Wᵀ`` can be split two ways:

* **by output columns** (:class:`ColumnParallelLinear`): rank r holds rows r of ``W`` (a slice of the
  outputs) and computes its slice of ``Y`` from the whole ``X``; no communication in forward;
* **by input rows** (:class:`RowParallelLinear`): rank r holds the matching slice of ``W``'s inputs, gets
  its slice of ``X`` and computes a *partial* ``Y``; the partials are summed by an all-reduce.

An MLP ``Row(gelu(Column(X)))`` then needs one all-reduce in forward (after the row layer) and one in
backward (the gradient of ``X``, summed over the column layer's ranks): the two conjugate operators

=========  ==========================  ==========================
operator   forward                     backward
=========  ==========================  ==========================
``f``      identity                    all-reduce (sum)
``g``      all-reduce (sum)            identity
=========  ==========================  ==========================

:func:`copy_to_tp` is ``f`` and :func:`reduce_from_tp` is ``g``. A transformer block is split by heads
and MLP columns (:func:`parallelize_block`); the embedding, the output layer and the loss are split by
vocabulary, and the whole GPT put together, in :mod:`labkit.parallel.tp.model`.

**Sequence parallelism** (``sequence_parallel=True``, :mod:`labkit.parallel.tp.sequence`) also splits the
activations *between* the split matrices — layer norms, dropouts, residuals — along the sequence: f
becomes an all-gather along the sequence and g a reduce-scatter (same wire bytes), and the replicated
parameters used there get partial gradients that :func:`~labkit.parallel.tp.sequence.sync_sequence_parallel_grads`
sums after backward.

Every collective goes through labkit's counted wrappers (``labkit.comm.collectives``), so the bytes a
layer puts on the wire can be compared with the analytic volume. ``group`` is the tp axis's group
(``labkit.comm.axes.AxisGroup``: the step says which timer counts that axis, so no layer carries one; a plain
process group or None, the world, is uncounted); with a group of one, every layer here is the ordinary one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group
from labkit.parallel.tp.sequence import (gather_from_sequence_shards, mark_sequence_parallel,
                                      reduce_scatter_to_sequence_shards)


def tp_rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(process_group(group)), dist.get_world_size(process_group(group))


def shard_bounds(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s equal slice of ``total`` among ``size`` ranks (which must divide it)."""
    if total % size:
        raise ValueError(f"{total} does not divide into {size} tensor-parallel shards")
    per = total // size
    return rank * per, (rank + 1) * per


def shard_range(total: int, group) -> tuple[int, int]:
    """[start, end) of this rank's slice of ``total`` in the tp ``group``."""
    return shard_bounds(total, *tp_rank_and_size(group))


# ---------------------------------------------------------------- the conjugate operators f and g

class _CopyToTP(torch.autograd.Function):
    """f: identity forward; the gradient is summed over the tp ranks in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the partial results are summed over the tp ranks in forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's slice of the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        rank, size = tp_rank_and_size(group)
        ctx.rank, ctx.size = rank, size
        gathered = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the ranks' slices, stacked along dim 0
        comm.all_gather(gathered, x.contiguous(), group)
        return torch.cat(gathered.chunk(size, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


# ``group`` is the tp axis's (labkit.comm.axes.AxisGroup): its collectives are counted on whatever timer the step
# set for that axis, so the operators read as in the paper
def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def enter_tp(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Into a column-parallel layer: f (replicated input), or f̄ (the sequence shards, all-gathered)."""
    return gather_from_sequence_shards(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_tp(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Out of a row-parallel layer (or the embedding): g (sum), or ḡ (sum, keeping this rank's tokens)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_shards(x, group)
    return reduce_from_tp(x, group)


# ---------------------------------------------------------------- layers

class ColumnParallelLinear(nn.Module):
    """``out_features / tp`` of a linear layer's outputs on each rank; ``gather_output`` concatenates them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel  # the input arrives as sequence shards (f̄, not f)
        start, end = shard_range(out_features, group)
        self.weight = nn.Parameter(torch.empty(end - start, in_features))
        self.bias = nn.Parameter(torch.zeros(end - start)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False,
                    sequence_parallel: bool = False):
        """This rank's slice of an existing layer (what every rank would hold of the same full weights)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, gather_output,
                    sequence_parallel)
        start, end = shard_range(linear.out_features, group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[start:end])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[start:end])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(enter_tp(x, self.group, self.sequence_parallel), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``in_features / tp`` of a linear layer's inputs on each rank; the partial outputs are summed (g), or
    summed and scattered along the sequence (ḡ) with ``sequence_parallel`` — then the bias, added to the
    sequence shard, gets a partial gradient (flagged for
    :func:`~labkit.parallel.tp.sequence.sync_sequence_parallel_grads`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        start, end = shard_range(in_features, group)
        self.weight = nn.Parameter(torch.empty(out_features, end - start))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # added once, after the sum
        nn.init.normal_(self.weight, std=0.02)
        if sequence_parallel and bias:
            mark_sequence_parallel(self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel: bool = False):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, sequence_parallel)
        start, end = shard_range(linear.in_features, group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:end])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        y = leave_tp(F.linear(x_shard, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- a transformer block, split

class TensorParallelAttention(nn.Module):
    """Causal self-attention with its heads split across the tp ranks (rank r computes heads
    ``[r·H/tp, (r+1)·H/tp)``): q, k, v by columns, the output projection by rows, one all-reduce each way."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head: int, attend, dropout: nn.Module):
        super().__init__()
        self.qkv, self.proj, self.n_head, self.attend, self.dropout = qkv, proj, n_head, attend, dropout

    @classmethod
    def from_attention(cls, attn, group=None, sequence_parallel: bool = False) -> "TensorParallelAttention":
        """This rank's heads of a ``labkit.model.gpt.CausalSelfAttention``, whose ``qkv`` rows are [q | k | v]."""
        _, size = tp_rank_and_size(group)
        if attn.n_head % size:
            raise ValueError(f"{attn.n_head} attention heads do not divide into {size} tensor-parallel ranks")
        width = attn.qkv.out_features // 3
        start, end = shard_range(width, group)  # this rank's heads, the same rows of q, of k and of v
        bias = attn.qkv.bias is not None
        qkv = ColumnParallelLinear(attn.qkv.in_features, 3 * width, bias, group,  # 3·width/tp rows
                                   sequence_parallel=sequence_parallel)
        rows = torch.cat([torch.arange(start, end) + part * width for part in range(3)])
        with torch.no_grad():
            qkv.weight.copy_(attn.qkv.weight[rows])
            if bias:
                qkv.bias.copy_(attn.qkv.bias[rows])
        proj = RowParallelLinear.from_linear(attn.proj, group, sequence_parallel)
        return cls(qkv, proj, attn.n_head // size, attn.attend, attn.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=2)  # each (B, T, this rank's heads × head_dim), the whole sequence
        B, T, width = q.shape
        q, k, v = (t.view(B, T, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).contiguous().view(B, T, width)
        return self.dropout(self.proj(y))


class TensorParallelMLP(nn.Module):
    """The 4× MLP: the expansion by columns, the projection back by rows (Megatron's MLP split)."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear, dropout: nn.Module):
        super().__init__()
        self.fc, self.proj, self.dropout = fc, proj, dropout

    @classmethod
    def from_mlp(cls, mlp, group=None, sequence_parallel: bool = False) -> "TensorParallelMLP":
        return cls(ColumnParallelLinear.from_linear(mlp.fc, group, sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_linear(mlp.proj, group, sequence_parallel), mlp.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def parallelize_block(block, group=None, sequence_parallel: bool = False):
    """Split a ``labkit.model.gpt.Block``'s attention and MLP across the tp ranks, in place. The layer norms
    stay replicated: each rank normalises the whole activation, or with ``sequence_parallel`` its tokens
    (then their parameters are flagged for :func:`~labkit.parallel.tp.sequence.sync_sequence_parallel_grads`).
    A mixture of experts in place of the MLP stays whole on every tp rank, as the norms do: its input is the whole
    activation there (expert parallelism, not tp, spreads its experts: :mod:`labkit.parallel.ep`). Returns the block."""
    from labkit.model.moe import MoE

    block.attn = TensorParallelAttention.from_attention(block.attn, group, sequence_parallel)
    if not isinstance(block.mlp, MoE):
        block.mlp = TensorParallelMLP.from_mlp(block.mlp, group, sequence_parallel)
    if sequence_parallel:
        mark_sequence_parallel(block.ln_1, block.ln_2)
    return block
