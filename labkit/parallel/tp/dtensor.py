"""Tensor parallelism the PyTorch way: DTensor's ``parallelize_module`` with a plan for labkit's GPT
(torchtitan's Llama plan before its config-based API), beside labkit's own (:mod:`labkit.parallel.tp.layers`).

A *plan* maps module names to parallel styles; each style turns the module's parameters into DTensors
(a tensor that knows how it is laid out over the mesh: ``Shard(d)`` or ``Replicate()``) and converts its
inputs and outputs at the boundary, inserting the collectives labkit writes by hand:

=====================  ==========================================  ===============================
module                 style                                       labkit's equivalent
=====================  ==========================================  ===============================
``wte``                ``RowwiseParallel`` (nn.Embedding: vocab)   ``VocabParallelEmbedding``
``attn.q``/``k``/``v``   ``ColwiseParallel``                         q/k/v rows of ``ColumnParallelLinear``
``attn.proj``          ``RowwiseParallel``                         ``RowParallelLinear``
``mlp.fc``/``proj``    ``ColwiseParallel`` / ``RowwiseParallel``   the same
``lm_head``            ``ColwiseParallel(output_layouts=Shard(-1),  ``VocabParallelHead``
                       use_local_output=False)``
the loss               ``loss_parallel()`` + ``F.cross_entropy``   ``vocab_parallel_cross_entropy``
norms (SP)             ``SequenceParallel``                        :mod:`labkit.parallel.tp.sequence`
=====================  ==========================================  ===============================

Three things labkit's model needs before the plan applies:

* **The fused q/k/v layer.** ``attn.qkv`` is one ``nn.Linear`` whose output rows are [q | k | v]; a plain
  ``ColwiseParallel`` cuts those 3·C rows into tp contiguous blocks — at tp = 2 rank 0 would get all of q
  and half of k — not "its heads of q, of k and of v". Here the module is cut first (:func:`split_qkv`:
  module surgery, the rows copied, so the numbers are the fused layer's) into three ``nn.Linear`` q, k, v,
  as torchtitan's Llama has them (``wq``, ``wk``, ``wv``); :func:`fused_qkv_state` joins them back for a
  checkpoint under the full model's names. The other way, a placement that shards each third on its own,
  is not among DTensor's public placements (``Shard``, ``Replicate``, ``Partial``).
* **The local head count.** After ``ColwiseParallel`` each rank's q has C/tp columns: :class:`SplitQKVAttention`
  derives its heads from the width it receives (width / head_dim), so the same module runs whole or split,
  and keeps labkit's ``attend`` kernel.
* **The tied embedding.** ``lm_head.weight`` *is* ``wte.weight``. Each style distributes the parameters of
  its own module, so the plan would leave two DTensors; both are ``Shard(0)`` of the same [V, C] matrix
  (the embedding by vocabulary rows, the head's output rows), so :func:`parallelize_gpt_dtensor` points
  the head at the embedding's DTensor again: one parameter, one gradient, as in the full model.

**Loss parallel.** The head's logits stay a DTensor sharded on the vocabulary; inside
``torch.distributed.tensor.parallel.loss_parallel()`` ``F.cross_entropy`` of it computes the softmax
from the slices (no full-vocabulary row is gathered). The *backward* must run inside the same context:
use :func:`loss_parallel_context` around forward and backward.

**Sequence parallelism** (``sequence_parallel=True``): the embedding's output is reduce-scattered to
sequence shards (``output_layouts=Shard(1)``), the norms are ``SequenceParallel``, attention and the MLP
all-gather their input (``PrepareModuleInput`` Shard(1) → Replicate), their output projections
reduce-scatter (``RowwiseParallel(output_layouts=Shard(1))``), and the head all-gathers before the
vocabulary-sharded logits. labkit's GPT adds a learned position embedding (Llama has none): its output
is cut to this rank's positions (``PrepareModuleOutput`` Replicate → Shard(0)); its weight stays a plain
tensor, and the backward of that cut all-gathers the positions' gradient, so every rank gets all of it.
The norms' weights are replicated DTensors whose gradients come out ``Partial(sum)`` — summed by DTensor
only when asked: call :func:`reduce_partial_grads` after backward, this path's
``sync_sequence_parallel_grads``. The row layers' biases need nothing: their bias is added inside the
DTensor linear, before the reduce-scatter, and their gradients come out whole (``Replicate``).

**Counting.** ``CommDebugMode`` (``torch.distributed.tensor.debug``) counts DTensor's collectives per
module, forward and backward, but not their bytes; :class:`CollectiveBytes` adds those, in labkit's
wire-byte convention (:func:`count_dtensor_collectives` runs both). Per block DTensor issues what labkit
does — 2 all-reduces forward and 2 backward; with sequence parallelism 2 all-gathers and 2
reduce-scatters each way — with the same bytes (``labkit.parallel.tp.volume``), provided the attention's
input enters once (the ``PrepareModuleInput`` on ``attn`` in :func:`block_plan`: without it q, k and v
each all-reduce their input gradient, 4 all-reduces backward per block instead of 2). With sequence
parallelism the whole model sends one more all-gather (the position embedding's gradient), and
:func:`reduce_partial_grads` one small all-reduce per norm parameter where labkit flattens them into one.

``torch.distributed.tensor`` costs most of a second to import; it is imported when first used.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.comm.collectives import wire_bytes


class SplitQKVAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections; the number of heads follows from the width
    the projections give (the whole model's, or this rank's share after ``ColwiseParallel``)."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear, head_dim: int, attend,
                 dropout: nn.Module):
        super().__init__()
        self.q, self.k, self.v, self.proj = q, k, v, proj
        self.head_dim, self.attend, self.dropout = head_dim, attend, dropout

    @classmethod
    def from_attention(cls, attn) -> "SplitQKVAttention":
        """The same layer as a ``labkit.model.gpt.CausalSelfAttention``, its fused [q | k | v] rows copied apart."""
        width, bias = attn.qkv.out_features // 3, attn.qkv.bias is not None
        parts = [nn.Linear(attn.qkv.in_features, width, bias=bias) for _ in range(3)]
        with torch.no_grad():
            for i, part in enumerate(parts):
                part.weight.copy_(attn.qkv.weight[i * width:(i + 1) * width])
                if bias:
                    part.bias.copy_(attn.qkv.bias[i * width:(i + 1) * width])
        return cls(*parts, attn.proj, width // attn.n_head, attn.attend, attn.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # each (B, T, heads here × head_dim)
        B, T, width = q.shape
        heads = width // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).contiguous().view(B, T, width)
        return self.dropout(self.proj(y))


def split_qkv(model) -> None:
    """Replace every block's fused-q/k/v attention by a :class:`SplitQKVAttention` (in place, same numbers)."""
    for block in model.blocks:
        block.attn = SplitQKVAttention.from_attention(block.attn)


def fused_qkv_state(state: dict) -> dict:
    """A state dict of the split-q/k/v model (whole tensors: ``full_tensor()`` first) under the full model's
    names again: ``attn.q``/``k``/``v`` joined into ``attn.qkv``, rows [q | k | v] — what a checkpoint of
    ``labkit.model.gpt.GPT`` holds."""
    out, parts = {}, {}
    for name, value in state.items():
        prefix, attn, rest = name.partition(".attn.")
        which, _, leaf = rest.partition(".")
        if attn and which in ("q", "k", "v"):
            fused = f"{prefix}.attn.qkv.{leaf}"
            out.setdefault(fused, None)  # keeps the model's order of names
            parts.setdefault(fused, {})[which] = value
        else:
            out[name] = value
    for fused, qkv in parts.items():
        out[fused] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return out


def block_plan(sequence_parallel: bool) -> dict:
    """The parallel styles of one ``labkit.model.gpt.Block`` (keys relative to the block)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "mlp.fc": ColwiseParallel()}
    if not sequence_parallel:  # norms replicated, nothing to say about them
        # the attention's input enters as one DTensor, so q's, k's and v's input gradients add up (Partial)
        # before one all-reduce, as in labkit's fused layer; without it each of the three all-reduces its own
        one_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        return plan | {"attn": one_input, "attn.proj": RowwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan | {"ln_1": SequenceParallel(), "attn": gather_sequence,
                   "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                   "ln_2": SequenceParallel(), "mlp": gather_sequence,
                   "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def model_plan(sequence_parallel: bool) -> dict:
    """The parallel styles of the GPT around its blocks: embeddings, final norm and the tied head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    return plan


def parallelize_gpt_dtensor(model, tp_mesh, sequence_parallel: bool = False, make_real=None):
    """Split a ``labkit.model.gpt.GPT`` over the 1-D ``tp_mesh`` with DTensor (in place; every rank must pass
    the same full weights). The model returns DTensor logits sharded on the vocabulary; compute the loss,
    and run backward, inside :func:`loss_parallel_context`. A model built on the meta device passes
    ``make_real(unit, name)`` (:func:`labkit.parallel.parallelize.part_maker`): each block is made real just
    before it is cut (q, k, v apart) and distributed, the rest just before the model's plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    size = tp_mesh.size()
    if model.shape.n_head % size:
        raise ValueError(f"{model.shape.n_head} attention heads do not divide into {size} tensor-parallel ranks")
    if sequence_parallel and model.shape.block_size % size:
        raise ValueError(f"sequence parallelism splits each sequence across the tp ranks: block_size "
                         f"{model.shape.block_size} is not divisible by the tp degree {size}")
    make_real = make_real or (lambda unit, name: None)
    for index, block in enumerate(model.blocks):
        make_real(block, f"blocks.{index}")
        block.attn = SplitQKVAttention.from_attention(block.attn)
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    make_real(model, "")
    parallelize_module(model, tp_mesh, model_plan(sequence_parallel))
    model.lm_head.weight = model.wte.weight  # the tie: both were distributed as Shard(0) of the same matrix
    return model


def reduce_partial_grads(model) -> None:
    """Sum the gradients DTensor left *partial* (call after backward, before clipping or the optimizer).

    With sequence parallelism a ``SequenceParallel`` norm's weight is a Replicate DTensor computed on
    sequence shards: its gradient comes out ``Partial(sum)``, each rank holding its tokens' share, and DTensor
    sums it only when something asks for it (``full_tensor()``, a redistribution).
    ``to_local()`` of it is a share, not the gradient: a norm or a clip computed from local tensors would be
    wrong. This redistributes each to its parameter's placement (an all-reduce each): the DTensor path's
    counterpart of :func:`labkit.parallel.tp.sequence.sync_sequence_parallel_grads`."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(place.is_partial() for place in p.grad.placements):
            p.grad = p.grad.redistribute(placements=p.placements)


def loss_parallel_context():
    """``torch.distributed.tensor.parallel.loss_parallel()``: cross-entropy from vocabulary-sharded DTensor
    logits. Wrap the forward (or at least the loss) *and* the backward in it."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


_WIRE_OPERATION = {  # functional collective → its name in labkit.comm.collectives.wire_bytes
    "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class CollectiveBytes(TorchDispatchMode):
    """Counts the wire bytes of the functional collectives DTensor issues, in ``labkit.comm.collectives``'
    convention (``CommDebugMode`` counts calls only). DTensor turns a redistribution into plain-tensor
    ``_c10d_functional`` ops; those are the ones seen here. ``calls`` lists (operation, wire bytes)."""

    def __init__(self, group_size: int):
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.group_size, self.calls, self._dtensor = group_size, [], DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # a DTensor op: let DTensor desugar it, then see its collectives on plain tensors
        out = func(*args, **(kwargs or {}))
        op = func.__name__.split(".")[0]  # "all_reduce.default" → "all_reduce"
        if func.namespace in ("_c10d_functional", "c10d_functional") and op in _WIRE_OPERATION:
            full = args[0].numel() * args[0].element_size() * (self.group_size if op.startswith("all_gather") else 1)
            self.calls.append((op, wire_bytes(_WIRE_OPERATION[op], full, self.group_size)))
        return out

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.calls)


def count_dtensor_collectives(step, group_size: int) -> tuple[dict, CollectiveBytes]:
    """Run ``step()`` (say a forward and backward) under ``torch.distributed.tensor.debug.CommDebugMode``
    and :class:`CollectiveBytes`. Returns {module name: {"forward"/"backward": {collective: calls}}}
    (CommDebugMode's per-module counts; a module's count includes its submodules', "Global" is the
    whole step) and the byte counter."""
    from torch.distributed.tensor.debug import CommDebugMode

    with warnings.catch_warnings(), CommDebugMode() as mode, CollectiveBytes(group_size) as counted:
        # CommDebugMode's module tracker hooks backward; a module whose inputs need no gradient warns
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        step()
    per_module = {name: {key: {op.__name__: n for op, n in ops.items() if n} for key, ops in passes.items()}
                  for name, passes in mode.comm_module_counts.items()}
    return per_module, counted


__all__ = ["SplitQKVAttention", "split_qkv", "fused_qkv_state", "block_plan", "model_plan", "parallelize_gpt_dtensor",
           "reduce_partial_grads", "loss_parallel_context", "CollectiveBytes",
           "count_dtensor_collectives"]
