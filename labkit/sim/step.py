"""The step-time and memory model: one optimizer step of a layout on a cluster, term by term.

This is a *model*. It is built from exact counts and the α–β network model and has three constants: two
efficiencies fitted to published runs and one slowdown measured by others; :mod:`labkit.sim.validate` reports
how far it lands from published runs.

Ranks are ordered tensor-parallel fastest, then data-parallel, then pipeline (Megatron-LM's order):
a TP group of ``tp`` neighbours sits inside a node when tp ≤ GPUs per node; DP and PP groups cross
nodes once their span (stride × size) exceeds a node, and then run at the inter-node link's speed.
Each rank of a replica does 1/(tp·pp) of the replica's FLOPs (the embedding and logits are spread
evenly over the stages, a small simplification). For one micro-batch on one rank:

* **compute** = model FLOPs / (MATMUL_EFFICIENCY · peak); forward is 1/3 of it, backward 2/3
  (labkit's count, 6N + 12·L·d·T per token, :func:`labkit.model.flops.flops_per_token`).
* **recompute** = the extra forward: full recompute reruns each block's forward
  (2·N_blocks + 4·L·d·T per token), selective only the attention core (4·L·d·T).
* **tp comm** = per layer, 4 all-reduces of micro_batch·seq·hidden activations (2 forward, 2
  backward; 2 more under full recompute). Sequence parallelism turns each into an all-gather plus a
  reduce-scatter: the same ring bytes. Not overlapped (Megatron-LM 2019–2022 did not).
* **attention memory** = the elementwise kernels on the s × s attention scores (softmax, dropout and their
  backward) stream the scores through HBM: they are memory-bound, so they cost bytes / memory bandwidth,
  not FLOPs. Per score element, forward: softmax reads and writes a value, dropout reads and writes one and
  writes a 1-byte mask (4 values + 1 byte); backward: dropout's reads the gradient and the mask and writes a
  gradient, softmax's reads the probabilities and the gradient and writes one (5 values + 1 byte); a
  recomputed attention core (selective or full) runs the forward kernels again. That is how Megatron-LM ran
  attention until 2022 (``attention="naive"``). FlashAttention (``attention="flash"``) never writes the
  scores: no memory term, but its backward recomputes QKᵀ (2·L·d·T FLOPs per token, counted as recompute).
* **elementwise memory** = the block's other memory-bound kernels — LayerNorm, bias-dropout-add, bias-GeLU —
  cost the bytes they read and write over the memory bandwidth (:data:`ELEMENTWISE_FORWARD`, Megatron-LM's
  fused kernels counted value by value). Without sequence parallelism every TP rank runs the LayerNorms and
  dropouts on the whole activation (Korthikanti et al. 2022, §4.2.2): that part does not shrink with tp, and is
  what sequence parallelism divides. A full recompute runs the forward ones again.
* **pp comm** = one activation sent forward and one gradient back per micro-batch and model chunk,
  each TP rank sending only its 1/tp slice (Megatron-LM's scatter/gather optimisation, Narayanan et al.
  2021 §4.1, on by default; with sequence parallelism the activations are split anyway).

Every collective costs ``rounds·α + bytes/(NETWORK_EFFICIENCY·β)`` with rounds and bytes from
:func:`labkit.comm.network.collective_cost` on the group's link, by the cheaper of the ring and the tree
(as NCCL picks per message: the tree's log p rounds win for small messages, the ring for large ones). A replica's busy time is
m × (the above); the **bubble** adds (p − 1)/(v·m) of it — so that bubble / (busy + bubble) is
:func:`labkit.parallel.pipeline.ideal_bubble` (p − 1)/(m + p − 1) for v = 1 (v: interleaved chunks).

**dp comm**: ZeRO 0–2 move the gradients once per step (an all-reduce; ZeRO-1/2's reduce-scatter +
all-gather has the same ring bytes) in buckets of ``bucket_bytes`` (torch DDP's 25 MiB), each paying its
own latency; with ``overlap_dp`` they hide under the last micro-batch's backward, except the last bucket,
which is ready only when backward ends, and whatever exceeds the backward. ``grad_compression`` divides
the bytes on the wire (a compressor's ratio); ``sync_every`` = H > 1 averages the replicas every H steps
after the optimizer (local SGD, DiLoCo): not overlapped, and 1/H of it per step. ZeRO-3 (FSDP) gathers
each layer's weights before its forward and its backward and reduce-scatters its gradients, every
micro-batch: forward gathers hide under the forward, the rest under the backward (recompute included),
the excess is exposed. A layer's recompute runs just before its backward, inside the same gather
(DeepSpeed's and FSDP's pre-backward fetch), so recompute adds no gather.

**overlap slowdown**: a collective hidden under compute is not free. Its kernels take some of the GPU's
SMs and memory bandwidth, so the compute running beside it slows down: OVERLAP_COST × the hidden
communication time is added back: one number for every GPU and collective, not fitted but measured (Lee et
al. 2025, arXiv:2507.03114: on average 18.9% slower compute beside a collective). Without it the model
cannot hold both Shoeybi et al.'s 3–12 point drop from model parallel to model + data parallel (where the
gradient all-reduce fits under the backward) and ZeRO-3's measured fall with fewer tokens per GPU.

Step time = compute + recompute + attention memory + elementwise memory + tp comm + pp comm + bubble + dp
exposed + overlap slowdown. The optimizer update (memory-bound, a few ms), bias gradients and LayerNorm
statistics, and data loading are left out; so are hierarchical (node-aware) collectives: a group that crosses
nodes runs at the inter-node link's per-GPU share.

**Memory per GPU** is :func:`labkit.memory_estimate.estimate_memory` for the same layout (labkit's
parameter count split evenly over tp·pp, ZeRO's sharding over dp, ceil(L/pp) layers of Korthikanti et
al.'s activation bytes), with the activations times the micro-batches the first stage holds in flight
(:func:`in_flight`). ZeRO-3's gathered working layer and the logits' activations are not counted.
"""
from __future__ import annotations

import math
from typing import Optional

from labkit.comm.network import Cost, collective_cost
from labkit.memory_estimate import MemoryPlan, estimate_memory
from labkit.sim.cluster import Cluster, Link
from labkit.sim.layout import (ATTENTION, DDP_BUCKET_BYTES, PRECISIONS, RECOMPUTE, SCHEDULES,  # noqa: F401 (re-exported)
                               Layout, ModelShape, StepBreakdown)

# The model's three constants. Two are fitted once to all the published points together by
# labkit.sim.validate.fit_constants (the pair, on a 0.01 grid, that minimises the worst error in units of each
# table's bar); never tuned per point. tests/sim/test_validate.py checks that the fit still gives them.
MATMUL_EFFICIENCY = 0.64  # achieved fraction of the dense peak (fitted on the A100 runs)
NETWORK_EFFICIENCY = 0.69  # achieved fraction of a link's catalog bandwidth, every level (fitted)
# The third is measured, not fitted: Lee et al. 2025 (arXiv:2507.03114) timed GPT and LLaMA training kernels on
# A100, H100, MI250 and MI210 with and without a collective running beside them, and report an average compute
# slowdown of 18.9% (at most 40%).
OVERLAP_COST = 0.189  # compute under a hidden collective runs this fraction slower, for the collective's time

def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token, labkit's exact count (6N + 12·L·d·T)."""
    from labkit.model import flops  # lazy: it imports torch through labkit.model.gpt

    return flops.flops_per_token(shape.gpt_fields())


def block_params(shape: ModelShape) -> int:
    """Parameters of all transformer blocks (labkit's count): the matmuls recomputation reruns."""
    from labkit.model import flops

    return shape.layers * flops.count_params(shape.gpt_fields())["per_block"]


def recompute_flops_per_token(shape: ModelShape, recompute: str, attention: str = "naive") -> float:
    """Extra forward FLOPs per token: the blocks' forward (full), the attention core's (selective), plus
    FlashAttention's QKᵀ again in its backward (2·L·d·T)."""
    attention_core = 4.0 * shape.layers * shape.hidden * shape.seq  # QKᵀ and A·V, forward
    flash = attention_core / 2 if attention == "flash" else 0.0
    if recompute == "full":
        return 2.0 * block_params(shape) + attention_core + flash
    return (attention_core if recompute == "selective" else 0.0) + flash


def collective_seconds(op: str, nbytes: float, world: int, link: Link | None,
                       efficiency: Optional[float] = None) -> float:
    """α·rounds + bytes/(efficiency·β) of ``op`` on ``link`` by the cheapest of the link's algorithms (NCCL's ring
    or tree, as it picks per message; gloo's ring) — 0 for a group of one."""
    if link is None or world <= 1:
        return 0.0
    efficiency = NETWORK_EFFICIENCY if efficiency is None else efficiency

    def seconds(cost: Cost) -> float:
        return cost.rounds * link.latency + cost.bytes / (efficiency * link.bandwidth)
    if op == "send":
        return seconds(collective_cost(op, nbytes, world))
    return min(seconds(collective_cost(op, nbytes, world, algorithm)) for algorithm in link.algorithms)


def attention_memory_seconds(shape: ModelShape, layout: Layout, bandwidth: float,
                             elem: int) -> tuple[float, float]:
    """Seconds the score kernels (softmax, dropout) stream s × s scores through memory, per micro-batch on one
    rank: (forward, backward incl. any recomputed forward). 0 for FlashAttention, which never writes them."""
    if layout.attention == "flash":
        return 0.0, 0.0
    scores = layout.micro_batch * shape.heads / layout.tp * shape.seq ** 2 * math.ceil(shape.layers / layout.pp)
    forward, backward = scores * (4 * elem + 1), scores * (5 * elem + 1)  # values read and written, + the mask
    again = forward if layout.recompute != "none" else 0.0
    return forward / bandwidth, (backward + again) / bandwidth


# The memory traffic of one block's elementwise kernels, per token, in multiples of the hidden size: (values read
# and written, 1-byte dropout-mask bytes) for the kernels on hidden-wide tensors (LayerNorms, bias-dropout-add:
# every TP rank runs them whole unless sequence parallel) and on the MLP's 4·hidden-wide one (bias-GeLU: split over
# TP). Megatron-LM's fused kernels, counted one by one. Forward: each LayerNorm reads and writes a value (2 × 2);
# each bias-dropout-add reads two, writes one and a mask (2 × 3, + 2 mask bytes); bias-GeLU reads and writes
# 4 wide (8). Backward: each LayerNorm's reads x and the gradient and writes one (2 × 3); each dropout-add's reads
# the gradient and the mask and writes one, and the residual's gradient is added to the branch's, reading two and
# writing one (2 × 5, + 2 mask bytes); GeLU's reads its input and the gradient and writes one, 4 wide (12).
# Megatron-LM 2019 ran some of these unfused (more traffic): for it the term is a lower bound.
ELEMENTWISE_FORWARD = {"hidden": (10, 2), "wide": (8, 0)}
ELEMENTWISE_BACKWARD = {"hidden": (16, 2), "wide": (12, 0)}


def elementwise_memory_seconds(shape: ModelShape, layout: Layout, bandwidth: float,
                               elem: int) -> tuple[float, float]:
    """Seconds the elementwise kernels of the blocks (LayerNorm, bias-dropout-add, bias-GeLU) stream their
    activations through memory, per micro-batch on one rank: (forward, backward incl. a full recompute's forward).
    Without sequence parallelism the hidden-sized ones run on the whole activation on every TP rank."""
    elements = layout.micro_batch * shape.seq * math.ceil(shape.layers / layout.pp) * shape.hidden
    share = {"hidden": 1 / layout.tp if layout.sequence_parallel else 1.0, "wide": 1 / layout.tp}

    def seconds(kernels: dict) -> float:
        return sum(elements * share[k] * (values * elem + masks)
                   for k, (values, masks) in kernels.items()) / bandwidth
    forward = seconds(ELEMENTWISE_FORWARD)
    return forward, seconds(ELEMENTWISE_BACKWARD) + (forward if layout.recompute == "full" else 0.0)


def bucketed_seconds(op: str, nbytes: float, bucket: float, world: int, link: Link | None, net: float) -> tuple[float, float]:
    """``nbytes`` sent as ⌈nbytes / bucket⌉ collectives of equal size: (all of them, the last one) in seconds."""
    buckets = max(1, math.ceil(nbytes / bucket))
    one = collective_seconds(op, nbytes / buckets, world, link, net)
    return buckets * one, one


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, precision: str = "bf16",
              matmul_efficiency: Optional[float] = None, network_efficiency: Optional[float] = None,
              overlap_cost: Optional[float] = None) -> StepBreakdown:
    """Predicted time of one step and memory per GPU of ``layout`` for ``shape`` on ``cluster``."""
    eff = MATMUL_EFFICIENCY if matmul_efficiency is None else matmul_efficiency
    net = NETWORK_EFFICIENCY if network_efficiency is None else network_efficiency
    slow = OVERLAP_COST if overlap_cost is None else overlap_cost
    lay, p, m, v = layout, layout.pp, layout.micro_batches, layout.chunks
    if lay.gpus > cluster.gpus:
        raise ValueError(f"layout needs {lay.gpus} GPUs, {cluster.name} has {cluster.gpus}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    elem = PRECISIONS[precision]
    peak = cluster.gpu.peak_flops(precision)
    rate = eff * peak
    split = lay.tp * lay.pp
    tokens = lay.micro_batch * shape.seq  # per micro-batch
    layers_per_stage = math.ceil(shape.layers / p)

    # compute, recompute and the score kernels, per micro-batch on one rank
    model_fl = flops_per_token(shape) * tokens / split
    forward, backward = model_fl / 3 / rate, 2 * model_fl / 3 / rate
    recompute = (recompute_flops_per_token(shape, lay.recompute, lay.attention)
                 * tokens / split / rate)
    score_fwd, score_bwd = attention_memory_seconds(shape, lay, cluster.gpu.memory_bandwidth, elem)
    elt_fwd, elt_bwd = elementwise_memory_seconds(shape, lay, cluster.gpu.memory_bandwidth, elem)

    # tensor parallel: activations all-reduced inside the TP group
    tp_link = cluster.link_for(1, lay.tp)
    act_bytes = tokens * shape.hidden * elem
    n_tp = 4 + (2 if lay.recompute == "full" else 0)
    tp_comm = (layers_per_stage * n_tp
               * collective_seconds("all_reduce", act_bytes, lay.tp, tp_link, net))

    # pipeline: one send forward, one back, per micro-batch and chunk
    pp_link = cluster.link_for(lay.tp * lay.dp, p)
    send_bytes = act_bytes / (lay.tp if lay.sequence_parallel or lay.pp_scatter_gather else 1)
    pp_comm = 2 * v * collective_seconds("send", send_bytes, p, pp_link, net)

    busy = m * (forward + backward + recompute + score_fwd + score_bwd + elt_fwd + elt_bwd + tp_comm + pp_comm)
    bubble = busy * (p - 1) / (v * m)
    dp_total, hidden = dp_seconds(shape, lay, cluster, elem, net, (forward + score_fwd + elt_fwd,
                                                                  backward + recompute + score_bwd + elt_bwd))
    memory = rank_memory(shape, lay, precision)
    return StepBreakdown(
        compute=m * (forward + backward), recompute=m * recompute,
        attention_memory=m * (score_fwd + score_bwd), elementwise_memory=m * (elt_fwd + elt_bwd),
        tp_comm=m * tp_comm, pp_comm=m * pp_comm, bubble=bubble, dp_comm_hidden=hidden,
        dp_comm_exposed=dp_total - hidden, overlap_slowdown=slow * hidden,
        model_flops=flops_per_token(shape) * tokens * m * lay.dp, gpus=lay.gpus, peak_flops=peak,
        memory_parameters=memory["parameters"], memory_gradients=memory["gradients"],
        memory_optimizer=memory["optimizer"], memory_activations=memory["activations"],
        gpu_memory=cluster.gpu.memory_bytes)


def dp_seconds(shape: ModelShape, lay: Layout, cluster: Cluster, elem: int, net: float,
               windows: tuple[float, float]) -> tuple[float, float]:
    """Data-parallel communication per step, and the part of it hidden: (total, hidden) in seconds.

    ``windows`` = one micro-batch's (forward, backward incl. recompute) on this rank: what the
    gathers of ZeRO-3 hide under, and (the backward) what the gradient buckets of ZeRO 0-2 hide
    under."""
    dp_link = cluster.link_for(lay.tp, lay.dp)
    wbytes = flops_params(shape) / (lay.tp * lay.pp) * elem
    fwd_window, bwd_window = windows if lay.overlap_dp else (0.0, 0.0)
    if lay.zero < 3:
        total, last = bucketed_seconds("all_reduce", wbytes / lay.grad_compression,
                                       lay.bucket_bytes, lay.dp, dp_link, net)
        if lay.sync_every > 1:  # replicas averaged after the optimizer: nothing to hide under
            return total / lay.sync_every, 0.0
        return total, max(0.0, min(total - last, bwd_window))
    layers = math.ceil(shape.layers / lay.pp)  # one gather (and one reduce-scatter) per layer
    gather, _ = bucketed_seconds("all_gather", wbytes, wbytes / layers, lay.dp, dp_link, net)
    scatter, _ = bucketed_seconds("reduce_scatter", wbytes / lay.grad_compression, wbytes / layers,
                                  lay.dp, dp_link, net)
    fwd_comm, bwd_comm = gather, gather + scatter  # the recompute reuses the backward's gather
    hidden = min(fwd_comm, fwd_window) + min(bwd_comm, bwd_window)
    return lay.micro_batches * (fwd_comm + bwd_comm), lay.micro_batches * hidden


def total_params(shape: ModelShape) -> int:
    """All parameters, labkit's count (the token embedding shared with the output layer)."""
    from labkit.model import flops

    return flops.count_params(shape.gpt_fields())["total"]


def flops_params(shape: ModelShape) -> int:
    """Parameters taking part in matmuls (labkit's count: all but the position embedding)."""
    from labkit.model import flops

    return flops.count_params(shape.gpt_fields())["flops_params"]


def in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first stage holds at once: m (GPipe), min(p, m) (1F1B).
    Interleaving keeps a little more (Narayanan et al. 2021, §2.2.2); it is counted as 1F1B here."""
    if layout.pp == 1:
        return 1
    return layout.micro_batches if layout.schedule == "gpipe" else min(layout.pp, layout.micro_batches)


def rank_memory(shape: ModelShape, layout: Layout, precision: str = "bf16") -> dict:
    """Bytes per GPU: :func:`labkit.memory_estimate.estimate_memory` for the same layout (an even split
    of labkit's parameter count over tp·pp, ZeRO sharding over dp, ceil(L/pp) layers of activations),
    with the activations times the micro-batches the first stage holds in flight."""
    plan = MemoryPlan(params=total_params(shape), n_layer=shape.layers,
                      hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab, seq_len=shape.seq,
                      micro_batch=layout.micro_batch, precision="fp32" if precision == "fp32" else "mixed",
                      dp=layout.dp, zero_stage=layout.zero, tp=layout.tp, pp=layout.pp,
                      recompute=layout.recompute, sequence_parallel=layout.sequence_parallel)
    est = estimate_memory(plan)
    return {"parameters": est.parameters, "gradients": est.gradients, "optimizer": est.optimizer_state,
            "activations": est.activations * in_flight(layout)}

