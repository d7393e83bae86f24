"""Tensor parallelism's wire bytes on paper: every collective of one forward + backward, per rank.

A pure function of the model's shape, counted the way ``labkit.comm.collectives`` counts (ring
algorithms, bytes one rank sends: an all-reduce of n bytes 2(p−1)/p·n, an all-gather or a
reduce-scatter (p−1)/p·n of the *whole* tensor), so that labkit's ``CommTimer`` must agree with it to
the byte. With ``a`` = one activation of the residual stream, micro_batch × seq × n_embd elements:

=============  =========================================  ===========================================
part           without sequence parallelism               with sequence parallelism
=============  =========================================  ===========================================
embedding      g: all-reduce a (forward)                  ḡ: reduce-scatter a, all-gather a (backward)
each block     2 f + 2 g: 4 all-reduces of a              2 f̄ + 2 ḡ: 4 all-gathers + 4 reduce-scatters
head           f: all-reduce a (backward)                 f̄: all-gather a, reduce-scatter a (backward)
loss           3 all-reduces of micro_batch × seq fp32    the same (computed on the gathered sequence)
=============  =========================================  ===========================================

An all-reduce *is* a reduce-scatter followed by an all-gather, so both columns send the same bytes:
per block 8·(p−1)/p·a·dtype_bytes. Sequence parallelism adds one small all-reduce after backward, of the
gradients of the replicated parameters used on sequence shards (:func:`sequence_parallel_sync_bytes`).

**Recomputation** (activation checkpointing) reruns a region's forward in backward, collectives included —
but torch's non-reentrant checkpoint stops rerunning once every tensor saved for backward is back (its
"early stop"), and nothing saves the output of the collective that *ends* a region (the row layer's g or
ḡ, before the residual add). So "selective" (the attention: ln_1 → attention → proj) reruns nothing
without sequence parallelism and the q/k/v input's all-gather with it; "full" (the whole block) reruns
the attention's g (one all-reduce) without, and all-gather, reduce-scatter, all-gather with it.

``dtype_bytes`` is the size of the activations at the collectives: 4 in fp32. Under bf16 autocast they
mix — a row-parallel layer's output is bf16, but the gradient reaching a column layer's fp32 input (a
layer norm's output) is fp32 — so this count is exact for one dtype throughout.
"""
from __future__ import annotations

from labkit.comm.collectives import wire_bytes

LOSS_BYTES = 4  # the loss's per-token numbers (max, target logit, sum of exponentials) are fp32

RECOMPUTE_MODES = ("none", "selective", "full")  # as labkit.model.gpt.Block's recompute


def tp_collectives(micro_batch: int, seq_len: int, n_embd: int, n_layer: int, tp: int, dtype_bytes: int = 4,
                   sequence_parallel: bool = False, recompute: str = "none") -> dict[str, list[tuple[str, str, int]]]:
    """The collectives of one forward + backward, per part ("embedding", "block" — each of the ``n_layer``
    alike —, "head", "loss", and "moe_block": a block whose MLP is a mixture of experts, whole on every tp rank, so
    only its attention's): (pass, operation, bytes of the whole tensor) in the order they run.
    ``tp`` only checks; the bytes on the wire follow from it in :func:`tp_wire_bytes`."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: expected one of {RECOMPUTE_MODES}")
    if tp < 1 or n_layer < 0:
        raise ValueError(f"tp must be >= 1 and n_layer >= 0, got tp={tp}, n_layer={n_layer}")
    activation = micro_batch * seq_len * n_embd * dtype_bytes
    if sequence_parallel:
        enter = [("forward", "all_gather", activation), ("backward", "reduce_scatter", activation)]  # f̄
        leave = [("forward", "reduce_scatter", activation), ("backward", "all_gather", activation)]  # ḡ
    else:
        enter = [("backward", "all_reduce", activation)]  # f
        leave = [("forward", "all_reduce", activation)]  # g
    attention = mlp = enter + leave  # q/k/v (column) then proj (row); fc (column) then proj (row)
    per_token = ("forward", "all_reduce", micro_batch * seq_len * LOSS_BYTES)
    attention_rerun = [("backward (recompute)", op, nbytes) for when, op, nbytes in attention if when == "forward"]
    return {"embedding": leave,
            "block": attention + mlp + rerun_in_backward({"none": [], "selective": attention,
                                                          "full": attention + mlp}[recompute]),
            # a full recompute reruns the attention's closing g too: the mixture of experts after it needs its output
            "moe_block": attention + {"none": [], "selective": rerun_in_backward(attention),
                                      "full": attention_rerun}[recompute],
            "head": enter,
            "loss": [per_token] * 3}


def rerun_in_backward(region: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The collectives a checkpointed region's recomputation sends again: its forward ones but the last
    (the region's closing g or ḡ, whose output nothing saves: the checkpoint stops before it)."""
    forward = [(op, nbytes) for when, op, nbytes in region if when == "forward"]
    return [("backward (recompute)", op, nbytes) for op, nbytes in forward[:-1]]


def tp_wire_bytes(micro_batch: int, seq_len: int, n_embd: int, n_layer: int, tp: int, dtype_bytes: int = 4,
                  sequence_parallel: bool = False, recompute: str = "none") -> dict[str, int]:
    """Bytes one tp rank sends in one forward + backward of the whole GPT: "embedding", "per_layer",
    "blocks" (n_layer × per_layer), "head", "loss" and "total"; "per_moe_layer", what a block whose MLP is a mixture
    of experts sends instead of "per_layer"."""
    parts = tp_collectives(micro_batch, seq_len, n_embd, n_layer, tp, dtype_bytes, sequence_parallel, recompute)
    sent = {part: sum(wire_bytes(op, nbytes, tp) for _, op, nbytes in ops) for part, ops in parts.items()}
    out = {"embedding": sent["embedding"], "per_layer": sent["block"], "blocks": n_layer * sent["block"],
           "head": sent["head"], "loss": sent["loss"], "per_moe_layer": sent["moe_block"]}
    out["total"] = out["embedding"] + out["blocks"] + out["head"] + out["loss"]
    return out


def sequence_parallel_grad_numel(n_embd: int, n_layer: int, block_size: int, bias: bool) -> int:
    """Elements of the gradients sequence parallelism all-reduces after backward: the position embedding,
    every layer norm (2 per block and the final one; weight, and bias if ``bias``) and, if ``bias``, the
    two row-parallel biases per block."""
    norms = (2 * n_layer + 1) * n_embd * (2 if bias else 1)
    row_biases = 2 * n_layer * n_embd if bias else 0
    return block_size * n_embd + norms + row_biases


def sequence_parallel_sync_bytes(n_embd: int, n_layer: int, block_size: int, bias: bool, tp: int,
                                 grad_bytes: int = 4) -> int:
    """Bytes one rank sends for that one all-reduce (``labkit.parallel.tp.sequence.sync_sequence_parallel_grads``)."""
    return wire_bytes("all_reduce", sequence_parallel_grad_numel(n_embd, n_layer, block_size, bias) * grad_bytes, tp)
