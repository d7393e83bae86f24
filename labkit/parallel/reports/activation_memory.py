"""Activation memory: what each rank's forward keeps for backward, predicted tensor by tensor beside what the run
measured.

Korthikanti et al. (2022, Table 2; :func:`labkit.memory_estimate.activation_bytes_per_layer`) count what a
Megatron transformer layer saves in fp16 with dropout: s·b·h·(34 + 5·a·s/h) bytes. labkit's block saves the
same tensors, in the width the run computes in, with what its attention kernel keeps instead of the a × s × s
probabilities. Here is that count for labkit's own modules (its GPT, its tensor and sequence parallelism, its
pipeline stages), in values of s·b·h (s the sequence, b the micro-batch, h the width, t the tp degree, w bytes
per value):

==============================  =================  ========================  ===================================
kept for backward               labkit (values)    the paper's fp16 bytes    sharded by
==============================  =================  ========================  ===================================
the two layer norms' inputs     2                  4                         the sequence (SP)
q/k/v's and the MLP's inputs    2                  4                         nothing (labkit's SP keeps them
                                                                             gathered; Megatron's re-gathers)
q, k, v                         3                  6                         heads (tp)
the attention's output          1                  2                         heads (tp)
GeLU's input and output         8                  16                        MLP columns (tp)
two dropout masks               2 (if dropout)     2 (1 byte each)           the sequence (SP)
the probabilities (naive only)  a·s/h              5·a·s/h (with dropout)    heads (tp)
==============================  =================  ========================  ===================================

plus small terms the paper leaves out: each layer norm's mean and 1/σ (8 bytes per token), a fused kernel's
log-sum-exp (4 bytes per head and token). A pipeline stage holds its ``partition``'s blocks; the first also the
token ids (and under tp the mask of ids it does not own), the last the final layer norm's input, the output
layer's input, the softmax of its slice of the logits and the targets. A micro-batch's bytes times the
micro-batches a stage holds at once (``pipeline.peak_activations_in_flight``: m for GPipe, p − stage for
1F1B; one without a pipeline, whose backward follows each forward) is its peak activation memory.

Under context parallelism a rank keeps all of the above for its own block_size / cp tokens, its positions among
them, and what labkit's context-parallel attention saves in place of a kernel's: q, k, v, its output (and the
projection's input, a second copy) and a log-sum-exp — the same count with s ÷ cp. The ring keeps them for its own
chunks; Ulysses for all tokens of h ÷ cp heads, the same bytes; the all-gather variant keeps, besides, the whole
sequence's keys and values it gathered: 2·cp times a rank's own k (``gathered keys and values``), in every layer.

The count is for fp32 runs of labkit's modules, under any data-parallel strategy (FSDP2's gathered weights are
weights, not activations: ``labkit.metrics.memory.count_saved_bytes`` leaves Parameters out). On the CPU it is
what autograd saves to the byte, less a few scalars (``SCALAR_SLACK``): ``tests/parallel`` checks it on every
layout they run. Elsewhere the prediction is None and ``why_not`` says why: bf16 autocast keeps some tensors in
fp32 and casts copies of others, DTensor's modules save their own tensors. torch's pipeline
(``parallel.pp.impl=torch``) runs its own loop, which the run does not count: its ``measured`` is None.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from labkit.memory_estimate import activation_bytes_per_layer
from labkit.parallel.reports.layout import as_dims, start_event, steady_steps
from labkit.parallel.pp.pipeline import partition, peak_activations_in_flight

SCALAR_SLACK = 64  # bytes: scalars autograd keeps (a loss's total weight and the like), left out of the count
ID_BYTES = 8  # token ids, targets and positions are int64
STAT_BYTES = 8  # a layer norm's mean and 1/σ, fp32, per token
LSE_BYTES = 4  # a fused attention kernel's log-sum-exp, fp32, per head and token
# what an attention kernel keeps besides q, k and v, in values of s·b·h/t: its output and the output projection's
# input (one tensor when the kernel writes (b, s, heads, d), as sdpa's does), and whether it keeps the
# probabilities (a × s × s per sequence, plus the causal mask) or a log-sum-exp
# labkit's context-parallel attention saves q, k, v, its output and a log-sum-exp (the projection's input is a second
# copy of the output); all-gather KV also the whole sequence's keys and values ("gathered"). Not backends: what a
# rank's attention is under parallel.cp.impl, by that name
CP_ATTENTION = {impl: f"context-parallel {impl}" for impl in ("ring", "allgather", "ulysses")}
ATTENTION_KEEPS = {"sdpa": {"outputs": 1, "probabilities": False},
                   "labkit_flash": {"outputs": 2, "probabilities": False},
                   "naive": {"outputs": 1, "probabilities": True},
                   **{name: {"outputs": 2, "probabilities": False, "gathered": impl == "allgather"}
                      for impl, name in CP_ATTENTION.items()}}


def block_activation_parts(micro_batch: int, seq_len: int, hidden: int, heads: int, tp: int = 1, *,
                           value_bytes: int = 4, mask_bytes: int = 4, dropout: bool = False,
                           sequence_parallel: bool = False, recompute: str = "none",
                           attention: str = "sdpa", cp: int = 1) -> dict[str, float]:
    """Bytes one of labkit's blocks keeps for backward, for one micro-batch on one tp rank, named part by part.

    ``mask_bytes`` is a dropout mask's width: torch keeps it as a float of the activations' width on the CPU and
    as one byte where dropout is a fused kernel (CUDA). ``recompute="full"`` keeps the block's input alone;
    ``"selective"`` (labkit's: the attention sub-layer, its layer norm included, is checkpointed) keeps the
    sub-layer's input and what the MLP half keeps."""
    if attention not in ATTENTION_KEEPS:
        raise ValueError(f"attention backend {attention!r} is not modelled here "
                         f"(modelled: {', '.join(ATTENTION_KEEPS)})")
    sb, w, t = seq_len * micro_batch, value_bytes, tp
    sbh = sb * hidden
    seq = t if sequence_parallel else 1  # the residual stream is a sequence shard under SP
    if recompute == "full":
        return {"block input": w * sbh / seq}
    parts = {}
    if recompute == "selective":
        parts["attention sub-layer input"] = w * sbh / seq
    else:
        keeps = ATTENTION_KEEPS[attention]
        parts.update({"layer norm 1 input": w * sbh / seq, "layer norm 1 statistics": STAT_BYTES * sb / seq,
                      "q/k/v input": w * sbh, "q, k, v": 3 * w * sbh / t,
                      "attention output": keeps["outputs"] * w * sbh / t})
        if keeps.get("gathered"):  # every cp rank's keys and values (seq_len is a rank's own: s ÷ cp)
            parts["gathered keys and values"] = 2 * cp * w * sbh / t
        if keeps["probabilities"]:
            parts["attention probabilities"] = w * heads * seq_len * seq_len * micro_batch / t
            parts["causal mask"] = seq_len * seq_len  # one byte per (query, key)
        else:
            parts["log-sum-exp"] = LSE_BYTES * heads * sb / t
        if dropout:
            parts["attention dropout mask"] = mask_bytes * sbh / seq
    parts.update({"layer norm 2 input": w * sbh / seq, "layer norm 2 statistics": STAT_BYTES * sb / seq,
                  "MLP input": w * sbh, "GeLU input and output": 8 * w * sbh / t})
    if dropout:
        parts["MLP dropout mask"] = mask_bytes * sbh / seq
    return parts


def stage_end_parts(micro_batch: int, seq_len: int, hidden: int, vocab: int, tp: int = 1, *, first: bool,
                    last: bool, value_bytes: int = 4, mask_bytes: int = 4, dropout: bool = False,
                    sequence_parallel: bool = False) -> dict[str, float]:
    """What a stage keeps outside its blocks: the embedding on the first, the head and the loss on the last."""
    sb, w, t = seq_len * micro_batch, value_bytes, tp
    seq = t if sequence_parallel else 1
    parts = {}
    if first:
        parts.update({"token ids": ID_BYTES * sb, "positions": ID_BYTES * seq_len})
        if tp > 1:
            parts["ids this rank does not own"] = sb  # a bool per token
        if dropout:
            parts["embedding dropout mask"] = mask_bytes * sb * hidden / seq
    if last:
        parts.update({"final layer norm input": w * sb * hidden / seq,
                      "final layer norm statistics": STAT_BYTES * sb / seq,
                      "output layer input": w * sb * hidden, "softmax of the logits": w * sb * vocab / t,
                      "targets": ID_BYTES * sb})
        if tp > 1:
            parts["targets this rank owns"] = sb  # a bool per token
    return parts


def stage_activation_bytes(shape, micro_batch: int, stage: int, pp: int = 1, tp: int = 1, *, value_bytes: int = 4,
                           mask_bytes: int = 4, sequence_parallel: bool = False, cp: int = 1) -> float:
    """One micro-batch's activations on pipeline stage ``stage`` of ``pp`` (a tp rank of it): its blocks
    (:func:`block_activation_parts`) and its ends (:func:`stage_end_parts`). ``shape`` is a
    :class:`labkit.model.gpt.GPTShape`."""
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes, "dropout": shape.dropout > 0,
              "sequence_parallel": sequence_parallel}
    block = block_activation_parts(micro_batch, shape.block_size, shape.n_embd, shape.n_head, tp,
                                   recompute=shape.recompute, attention=shape.attention, cp=cp, **widths)
    ends = stage_end_parts(micro_batch, shape.block_size, shape.n_embd, shape.vocab_size, tp, first=stage == 0,
                           last=stage == pp - 1, **widths)
    return len(partition(shape, pp)[stage]) * sum(block.values()) + sum(ends.values())


def why_not_predicted(cfg, start: dict) -> Optional[str]:
    """Why a run's activations are not predicted here (None when they are)."""
    if cfg.precision.mode != "fp32":
        return (f"precision.mode={cfg.precision.mode}: autocast keeps some tensors in fp32 and casts copies of others; "
                "the count here is for fp32 runs")
    if start["mesh"].get("tp", 1) > 1 and cfg.parallel.tp.impl != "labkit":
        return "parallel.tp.impl=dtensor: DTensor's modules save their own tensors; the count is for labkit's"
    if start["mesh"].get("cp", 1) > 1:
        if cfg.parallel.cp.impl not in CP_ATTENTION:
            return (f"parallel.cp.impl={cfg.parallel.cp.impl}: torch's context_parallel runs its own kernels; the "
                    f"count is for labkit's ({', '.join(CP_ATTENTION)})")
        return None  # a rank keeps its own chunks' activations: counted with its tokens (see activation_memory)
    if cfg.attention.backend not in ATTENTION_KEEPS:
        return f"attention.backend={cfg.attention.backend} is not modelled (modelled: {', '.join(ATTENTION_KEEPS)})"
    return None


def activation_memory(events: list[dict], cfg, shape=None) -> dict:
    """Every rank's activations in a run's last step beside the prediction for its stage.

    Per rank: ``measured`` (``rank_activation_bytes``: what autograd saved in one micro-batch's forward there,
    None where the run did not count it, as under ``parallel.pp.impl=torch``), ``predicted``
    (:func:`stage_activation_bytes`), ``held`` (``rank_pipeline_in_flight``: the most micro-batches held at once;
    1 without a pipeline) beside ``held_predicted``, and the peaks: ``measured_peak`` read by the allocation tracker
    over the real schedule on the tracked step (:func:`tracked_activation_peaks`; without a pipeline, one micro-batch's
    saved tensors), ``predicted_peak`` = predicted × held_predicted. ``paper_per_layer`` is
    Korthikanti's fp16 count for one layer of this shape and layout, for reference. ``why_not`` says why
    ``predicted`` is None, if it is."""
    start, last = start_event(events), steady_steps(events)[-1]
    dims, m = as_dims(start["mesh"]), int(start["grad_accum"])
    if shape is None:
        from labkit.model.gpt import GPTShape

        shape = GPTShape.from_config(cfg.model, start["vocab_size"], cfg.attention.backend)
    if dims.cp > 1:  # a rank of a cp group holds block_size / cp tokens, attended by labkit's cp attention
        shape = dataclasses.replace(shape, block_size=shape.block_size // dims.cp,
                                    attention=CP_ATTENTION.get(cfg.parallel.cp.impl, shape.attention))
    sp = bool(cfg.parallel.tp.sequence_parallel) and dims.tp > 1
    why_not = why_not_predicted(cfg, start)
    value_bytes = 4
    mask_bytes = 1 if start.get("device") == "cuda" else value_bytes
    measured = last.get("rank_activation_bytes") or [None] * dims.world_size
    held = last.get("rank_pipeline_in_flight") or [None] * dims.world_size
    tracked = tracked_activation_peaks(events, dims.world_size)
    rows = []
    for rank in range(dims.world_size):
        stage = dims.coordinate(rank)["pp"]
        predicted = None if why_not else stage_activation_bytes(shape, cfg.data.micro_batch_size, stage, dims.pp,
                                                                 dims.tp, value_bytes=value_bytes,
                                                                 mask_bytes=mask_bytes, sequence_parallel=sp,
                                                                 cp=dims.cp)
        n_held = held[rank] if dims.pp > 1 else 1
        n_held_predicted = peak_activations_in_flight(dims.pp, m, cfg.parallel.pp.schedule, stage) if dims.pp > 1 else 1
        rows.append({"rank": rank, **dims.coordinate(rank), "layers": len(partition(shape, dims.pp)[stage]),
                     "measured": measured[rank], "predicted": predicted,
                     "held": n_held, "held_predicted": n_held_predicted,
                     "measured_peak": tracked[rank] if dims.pp > 1 else measured[rank],
                     "predicted_peak": None if predicted is None else predicted * n_held_predicted})
    paper = activation_bytes_per_layer(shape.block_size * dims.cp, cfg.data.micro_batch_size, shape.n_embd,
                                       shape.n_head, dims.tp, shape.recompute, sequence_parallel=sp, cp=dims.cp)
    return {"rows": rows, "micro_batches": m, "schedule": cfg.parallel.pp.schedule if dims.pp > 1 else None,
            "paper_per_layer": paper, "why_not": why_not}


def tracked_activation_peaks(events: list[dict], world: int) -> list:
    """Each rank's activation peak as the allocation tracker read it over the real schedule, on the run's tracked
    step (``rank_activation_peak_bytes``: :class:`labkit.parallel.pp.pipeline.ActivationPeak`); None where no step
    was tracked."""
    for e in events:
        peaks = e.get("rank_activation_peak_bytes") if e.get("type") == "step" else None
        if peaks and any(v is not None for v in peaks):
            return peaks
    return [None] * world


def format_activation_memory(report: dict) -> str:
    """:func:`activation_memory` as a plain-text table (MB = 1e6 bytes)."""
    def mb(v):
        return "n/a" if v is None else f"{v / 1e6:.3f}"

    lines = [f"{'rank':>4s} {'dp pp tp':>8s} {'layers':>6s} {'measured MB':>11s} {'predicted MB':>12s} "
             f"{'held':>9s} {'peak MB':>8s} {'predicted peak MB':>17s}"]
    for r in report["rows"]:
        held = f"{r['held'] if r['held'] is not None else 'n/a'} ({r['held_predicted']})"
        lines.append(f"{r['rank']:4d} {r['dp']:>2d} {r['pp']:>2d} {r['tp']:>2d} {r['layers']:6d} "
                     f"{mb(r['measured']):>11s} {mb(r['predicted']):>12s} {held:>9s} {mb(r['measured_peak']):>8s} "
                     f"{mb(r['predicted_peak']):>17s}")
    if report["why_not"]:
        lines.append(f"not predicted: {report['why_not']}")
    return "\n".join(lines)
