"""The step-time and memory model: one optimizer step of a layout on a cluster, term by term.

This is a *model*. It is built from exact counts and the α–β network model and has four constants
(:data:`PARAMETERS`): two efficiencies fitted to published runs, the V100's matmul rate derived from one published
point, and one slowdown measured by others; :mod:`labkit.sim.validate` reports how far it lands from published runs,
in sample and with each paper held out.

Ranks are ordered tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline (Megatron-LM's
order, tp-cp-dp-pp; labkit's mesh, :data:`labkit.parallel.mesh.AXES`, is the same, written outermost first): a TP
group of ``tp`` neighbours sits inside a node when tp ≤ GPUs per node, a CP group of cp ranks tp apart when tp·cp ≤
GPUs per node; DP and PP groups cross nodes once their span (stride × size) exceeds a node, and then run at the
inter-node link's speed. Each rank of a replica does 1/(tp·pp·cp) of the replica's FLOPs (the embedding and logits
are spread evenly over the stages, a small simplification; under context parallelism the attention core's share of
the busiest cp rank is the mean's × the causal imbalance, :mod:`labkit.sim.context`). For one micro-batch on one
rank:

* **compute** = model FLOPs / (the GPU's matmul efficiency · peak · the share of it the layer's GEMM shapes can
  use); forward is 1/3 of it, backward 2/3 (labkit's count, 6N + 12·L·d·T per token,
  :func:`labkit.model.flops.flops_per_token`). The matmul efficiency (:func:`gpu_matmul_efficiency`) is what a full
  tile reaches; the share (:func:`labkit.sim.gemm.layer_share`) takes off the tile and wave quantisation of each
  GEMM the blocks and the output layer run, and binds a GEMM too narrow for its FLOPs to memory bandwidth.
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
* **cp comm** = context parallelism's collectives, per layer forward and backward, the bytes of
  :func:`labkit.parallel.cp.volume.cp_wire_bytes` (:func:`labkit.sim.context.cp_messages`); not overlapped. Each rank
  holds micro_batch·seq/cp tokens, so every term above that counts tokens divides by cp.

Every collective costs ``rounds·α + bytes/(NETWORK_EFFICIENCY·β)`` on the group's link, by the cheaper of
NCCL's two algorithms (:mod:`labkit.sim.collective`), as NCCL picks per message: the ring (2(p−1) rounds, 2(p−1)/p·n
bytes per rank for an all-reduce) or, for the all-reduce only, NCCL's pipelined double binary tree (2⌈log₂ p⌉ rounds,
about 2n bytes per rank: not the textbook tree's 2⌈log₂ p⌉·n). The tree's fewer rounds win at small messages and
large p; at large messages the ring's (p−1)/p saves a little. What each term sends is written once, in
:func:`tp_messages`, :func:`pp_messages`, :func:`dp_messages` and :func:`labkit.sim.context.cp_messages` (the dry run
checks them against labkit's real code).
A replica's busy time is m × (the above); the **bubble** adds (p − 1)/(v·m) of it — so that bubble / (busy + bubble) is
:func:`labkit.parallel.pp.pipeline.ideal_bubble` (p − 1)/(m + p − 1) for v = 1 (v: interleaved chunks).

**dp comm** runs over the dp·cp ranks that hold the same parameters (``Layout.gradient_ranks``: with context
parallelism, dp × cp, tp apart). ZeRO 0–2 move every gradient once per step (an all-reduce; ZeRO-1/2's
reduce-scatter + all-gather has the same ring bytes, and is costed as the all-reduce, tree included) in buckets of
``bucket_bytes`` (torch DDP's 25 MiB), each paying its own latency; with ``overlap_dp`` they hide under the last
micro-batch's backward, except the last bucket, which is ready only when backward ends, and whatever exceeds the
backward. ``grad_compression`` divides the bytes on the wire (a compressor's ratio); ``sync_every`` = H > 1 averages
the replicas every H steps after the optimizer (local SGD, DiLoCo): not overlapped, and 1/H of it per step.
ZeRO-3 (FSDP) gathers each layer's weights before its forward and its backward and reduce-scatters its gradients, every
micro-batch: forward gathers hide under the forward, the rest under the backward (recompute included),
the excess is exposed. A layer's recompute runs just before its backward, inside the same gather
(DeepSpeed's and FSDP's pre-backward fetch), so recompute adds no gather.

**overlap slowdown**: a collective hidden under compute is not free. Its kernels take some of the GPU's
SMs and memory bandwidth, so the compute running beside it slows down: OVERLAP_COST × the hidden
communication time is added back: one number for every GPU and collective, not fitted but measured (Lee et
al. 2025, arXiv:2507.03114: on average 18.9% slower compute beside a collective). Without it the model
cannot hold both Shoeybi et al.'s 3–12 point drop from model parallel to model + data parallel (where the
gradient all-reduce fits under the backward) and ZeRO-3's measured fall with fewer tokens per GPU.

Step time = compute + recompute + attention memory + elementwise memory + tp comm + cp comm + pp comm + bubble
+ dp exposed + overlap slowdown. The optimizer update (memory-bound, a few ms), bias gradients and LayerNorm
statistics, and data loading are left out; so are hierarchical (node-aware) collectives: a group that crosses
nodes runs at the inter-node link's per-GPU share.

**Memory per GPU** is :func:`labkit.sim.memory.rank_memory`: :func:`labkit.memory_estimate.estimate_memory` for the
same layout, the activations times the micro-batches in flight, and what one layer needs while it runs (ZeRO-3's
gathered layer and its gradient, the recompute working set).
"""
from __future__ import annotations

import math
from typing import Optional

from labkit.sim import gemm
from labkit.sim.cluster import V100, Cluster, Link
from labkit.sim.context import attention_imbalance, cp_link, cp_messages, cp_problems
from labkit.sim.experts import ep_link, ep_messages, ep_problems, expert_parameters, imbalance_flops_per_token
from labkit.sim.collective import collective_seconds  # noqa: F401 (re-exported)
from labkit.sim.memory import block_params, in_flight, rank_memory, total_params  # noqa: F401 (re-exported)
from labkit.sim.layout import (ATTENTION, DDP_BUCKET_BYTES, PRECISIONS, RECOMPUTE, SCHEDULES,  # noqa: F401 (re-exported)
                               Layout, ModelShape, StepBreakdown)

# The model's constants (the GEMM tile and each GPU's SM count in labkit.sim.gemm are hardware facts, assumed, not
# counted). Two are fitted once to all the published points together by
# labkit.sim.validate.fit_constants (the pair, on a 0.01 grid, that minimises the worst error in units of each
# table's bar); never tuned per point. tests/sim/test_validate.py checks that the fit still gives them.
MATMUL_EFFICIENCY = 0.69  # achieved fraction of the dense peak by a full GEMM tile (fitted on the A100 runs)
NETWORK_EFFICIENCY = 0.74  # achieved fraction of a link's catalog bandwidth, every level (fitted)
# One is measured, not fitted: Lee et al. 2025 (arXiv:2507.03114) timed GPT and LLaMA training kernels on
# A100, H100, MI250 and MI210 with and without a collective running beside them, and report an average compute
# slowdown of 18.9% (at most 40%).
OVERLAP_COST = 0.189  # compute under a hidden collective runs this fraction slower, for the collective's time
# One is derived, not fitted: the V100's matmul efficiency, the one at which the model's 1-GPU step of Shoeybi et
# al. 2019's 1.2B model runs at their measured 39 TFLOP/s (labkit.sim.validate.v100_2019_efficiency; its test checks
# that it still gives this). 2019's V100 kernels did not reach the A100 runs' fraction of peak. It is a parameter of
# the model, derived from one published point (that point, the weak-scaling baseline, is then no test of it).
V100_MATMUL_EFFICIENCY = 0.345
MATMUL_EFFICIENCY_BY_GPU = {V100.name: V100_MATMUL_EFFICIENCY}  # a GPU with its own rate; the others: the fitted one
# Every constant above and what it is: labkit.sim.validate counts the fitted and the derived ones as the model's
# parameters (the measured one is someone else's measurement, taken as it is).
PARAMETERS = {"MATMUL_EFFICIENCY": "fitted", "NETWORK_EFFICIENCY": "fitted",
              "V100_MATMUL_EFFICIENCY": "derived from Shoeybi et al. 2019's 1-GPU baseline",
              "OVERLAP_COST": "measured by Lee et al. 2025"}


def gpu_matmul_efficiency(gpu) -> float:
    """The matmul efficiency the model runs ``gpu`` at: its own (:data:`MATMUL_EFFICIENCY_BY_GPU`), else the fitted
    :data:`MATMUL_EFFICIENCY`."""
    return MATMUL_EFFICIENCY_BY_GPU.get(gpu.name, MATMUL_EFFICIENCY)


def matmul_rate(shape: ModelShape, layout: Layout, gpu, precision: str, efficiency: Optional[float] = None) -> float:
    """FLOP/s the GEMMs of ``shape`` under ``layout`` run at on ``gpu``: the matmul efficiency (``efficiency``, else
    :func:`gpu_matmul_efficiency`) × the peak × the share the GEMMs' shapes use
    (:func:`labkit.sim.gemm.layer_share`)."""
    rate = (gpu_matmul_efficiency(gpu) if efficiency is None else efficiency) * gpu.peak_flops(precision)
    return rate * gemm.layer_share(shape, layout, gpu, PRECISIONS[precision], rate)


def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token, labkit's exact count (6N + 12·L·d·T)."""
    from labkit.model import flops  # lazy: it imports torch through labkit.model.gpt

    return flops.flops_per_token(shape.gpt_fields())


def attention_core_flops_per_token(shape: ModelShape) -> float:
    """The attention core's forward FLOPs per token, QKᵀ and A·V: 4·L·d·T (labkit's 12·L·d·T of training is three)."""
    return 4.0 * shape.layers * shape.hidden * shape.seq


def recompute_attention_flops_per_token(shape: ModelShape, recompute: str, attention: str = "naive") -> float:
    """The attention core's share of the recompute: its forward again (selective or full) plus FlashAttention's
    QKᵀ again in its backward (2·L·d·T)."""
    core = attention_core_flops_per_token(shape)
    return (core if recompute != "none" else 0.0) + (core / 2 if attention == "flash" else 0.0)


def recompute_flops_per_token(shape: ModelShape, recompute: str, attention: str = "naive") -> float:
    """Extra forward FLOPs per token: the blocks' forward (full), the attention core's (selective), plus
    FlashAttention's QKᵀ again in its backward (2·L·d·T)."""
    blocks = 2.0 * block_params(shape) if recompute == "full" else 0.0
    return blocks + recompute_attention_flops_per_token(shape, recompute, attention)


def busiest_flops(total: float, attention: float, lay: Layout) -> float:
    """``total`` FLOPs of the mean rank, its ``attention`` part run at the busiest cp rank's causal share
    (:func:`labkit.sim.context.attention_imbalance`)."""
    return total + (attention_imbalance(lay) - 1.0) * attention


def attention_memory_seconds(shape: ModelShape, layout: Layout, bandwidth: float,
                             elem: int) -> tuple[float, float]:
    """Seconds the score kernels (softmax, dropout) stream s × s scores through memory, per micro-batch on one
    rank: (forward, backward incl. any recomputed forward). 0 for FlashAttention, which never writes them.
    Under context parallelism a rank's s/cp queries meet the keys before them: the busiest cp rank's share
    of the scores."""
    if layout.attention == "flash":
        return 0.0, 0.0
    scores = layout.micro_batch * shape.heads / layout.tp * shape.seq ** 2 * math.ceil(shape.layers / layout.pp)
    scores *= attention_imbalance(layout) / layout.cp
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
    Without sequence parallelism the hidden-sized ones run on the whole activation on every TP rank (of the rank's
    seq/cp tokens under context parallelism)."""
    elements = layout.micro_batch * shape.seq / layout.cp * math.ceil(shape.layers / layout.pp) * shape.hidden
    share = {"hidden": 1 / layout.tp if layout.sequence_parallel else 1.0, "wide": 1 / layout.tp}

    def seconds(kernels: dict) -> float:
        return sum(elements * share[k] * (values * elem + masks)
                   for k, (values, masks) in kernels.items()) / bandwidth
    forward = seconds(ELEMENTWISE_FORWARD)
    return forward, seconds(ELEMENTWISE_BACKWARD) + (forward if layout.recompute == "full" else 0.0)


def bucketed_seconds(op: str, nbytes: float, bucket: float, world: int, link: Link | None,
                     net: float) -> tuple[float, float]:
    """``nbytes`` sent as ⌈nbytes / bucket⌉ collectives of equal size: (all of them, the last one) in seconds."""
    buckets = max(1, math.ceil(nbytes / bucket))
    one = collective_seconds(op, nbytes / buckets, world, link, net)
    return buckets * one, one


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, precision: str = "bf16",
              matmul_efficiency: Optional[float] = None, network_efficiency: Optional[float] = None,
              overlap_cost: Optional[float] = None) -> StepBreakdown:
    """Predicted time of one step and memory per GPU of ``layout`` for ``shape`` on ``cluster``."""
    eff = gpu_matmul_efficiency(cluster.gpu) if matmul_efficiency is None else matmul_efficiency
    net = NETWORK_EFFICIENCY if network_efficiency is None else network_efficiency
    slow = OVERLAP_COST if overlap_cost is None else overlap_cost
    lay, p, m, v = layout, layout.pp, layout.micro_batches, layout.chunks
    if lay.gpus > cluster.gpus:
        raise ValueError(f"layout needs {lay.gpus} GPUs, {cluster.name} has {cluster.gpus}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    refused = cp_problems(shape, lay) + ep_problems(shape, lay)
    if refused:
        raise ValueError("; ".join(refused))
    elem = PRECISIONS[precision]
    peak = cluster.gpu.peak_flops(precision)
    rate = matmul_rate(shape, layout, cluster.gpu, precision, eff)
    split = lay.tp * lay.pp
    tokens = lay.micro_batch * shape.seq / lay.cp  # this rank's, per micro-batch

    # compute, recompute and the score kernels, per micro-batch on one rank (the busiest cp rank's attention)
    attention_fl = 3 * attention_core_flops_per_token(shape)
    model_fl = busiest_flops(flops_per_token(shape), attention_fl, lay) * tokens / split
    forward, backward = model_fl / 3 / rate, 2 * model_fl / 3 / rate
    recompute = busiest_flops(recompute_flops_per_token(shape, lay.recompute, lay.attention),
                              recompute_attention_flops_per_token(shape, lay.recompute, lay.attention),
                              lay) * tokens / split / rate
    score_fwd, score_bwd = attention_memory_seconds(shape, lay, cluster.gpu.memory_bandwidth, elem)
    elt_fwd, elt_bwd = elementwise_memory_seconds(shape, lay, cluster.gpu.memory_bandwidth, elem)

    # tensor parallel (activations all-reduced inside the TP group) and pipeline (sends), per micro-batch
    (n_tp, tp_op, tp_bytes), (n_pp, pp_op, pp_bytes) = tp_messages(shape, lay, elem), pp_messages(shape, lay, elem)
    tp_comm = n_tp * collective_seconds(tp_op, tp_bytes, lay.tp, cluster.link_for(1, lay.tp), net)
    pp_comm = n_pp * collective_seconds(pp_op, pp_bytes, p, cluster.link_for(lay.tp * lay.cp * lay.dp, p), net)
    cp_comm = sum(n * collective_seconds(op, nbytes, lay.cp, cp_link(cluster, lay), net)
                  for n, op, nbytes in cp_messages(shape, lay, elem))
    ep_comm = sum(n * collective_seconds(op, nbytes, lay.ep, ep_link(cluster, lay), net)
                  for n, op, nbytes in ep_messages(shape, lay, elem))
    imbalance = imbalance_flops_per_token(shape, lay) * tokens / split / rate

    busy = m * (forward + backward + recompute + score_fwd + score_bwd + elt_fwd + elt_bwd + tp_comm + pp_comm
                + cp_comm + ep_comm + imbalance)
    bubble = busy * (p - 1) / (v * m)
    dp_total, hidden = dp_seconds(shape, lay, cluster, elem, net, (forward + score_fwd + elt_fwd,
                                                                  backward + recompute + score_bwd + elt_bwd))
    memory = rank_memory(shape, lay, precision)
    return StepBreakdown(
        compute=m * (forward + backward), recompute=m * recompute,
        attention_memory=m * (score_fwd + score_bwd), elementwise_memory=m * (elt_fwd + elt_bwd),
        tp_comm=m * tp_comm, cp_comm=m * cp_comm, pp_comm=m * pp_comm, bubble=bubble, dp_comm_hidden=hidden,
        ep_comm=m * ep_comm, expert_imbalance=m * imbalance,
        dp_comm_exposed=dp_total - hidden, overlap_slowdown=slow * hidden,
        model_flops=flops_per_token(shape) * lay.micro_batch * shape.seq * m * lay.dp, gpus=lay.gpus,
        peak_flops=peak,
        memory_parameters=memory["parameters"], memory_gradients=memory["gradients"],
        memory_optimizer=memory["optimizer"], memory_activations=memory["activations"],
        gpu_memory=cluster.gpu.memory_bytes)


def dp_seconds(shape: ModelShape, lay: Layout, cluster: Cluster, elem: int, net: float,
               windows: tuple[float, float]) -> tuple[float, float]:
    """Data-parallel communication per step, and the part of it hidden: (total, hidden) in seconds.

    ``windows`` = one micro-batch's (forward, backward incl. recompute) on this rank: what the
    gathers of ZeRO-3 hide under, and (the backward) what the gradient buckets of ZeRO 0-2 hide
    under. The group: the dp·cp ranks that hold the same parameters (``Layout.gradient_ranks``), tp apart."""
    world = lay.gradient_ranks
    dp_link = cluster.link_for(lay.tp, world)
    fwd_window, bwd_window = windows if lay.overlap_dp else (0.0, 0.0)
    if lay.zero < 3:
        [(_, op, nbytes)] = dp_messages(shape, lay, elem)
        total, last = bucketed_seconds(op, nbytes, lay.bucket_bytes, world, dp_link, net)
        if lay.sync_every > 1:  # replicas averaged after the optimizer: nothing to hide under
            return total / lay.sync_every, 0.0
        return total, max(0.0, min(total - last, bwd_window))
    (n, gather_op, layer_bytes), (_, scatter_op, grad_bytes) = dp_messages(shape, lay, elem)
    layers = n // (2 * lay.micro_batches)
    gather = layers * collective_seconds(gather_op, layer_bytes, world, dp_link, net)  # one layer at a time
    scatter = layers * collective_seconds(scatter_op, grad_bytes, world, dp_link, net)
    fwd_comm, bwd_comm = gather, gather + scatter  # the recompute reuses the backward's gather
    hidden = min(fwd_comm, fwd_window) + min(bwd_comm, bwd_window)
    return lay.micro_batches * (fwd_comm + bwd_comm), lay.micro_batches * hidden


# ---------------------------------------------------------------- the communication terms' collectives
# What each communication term sends, as (how many, the collective, bytes of each): step_time costs them, and the dry
# run (labkit.sim.dryrun_counts.model_terms) sets their ring bytes beside what labkit's real code sends.

def tp_messages(shape: ModelShape, lay: Layout, elem: int) -> tuple[int, str, float]:
    """Tensor parallel, per micro-batch on one rank: 4 all-reduces of the activation per layer of the stage (2
    forward, 2 backward), 2 more under full recompute (Megatron-LM's checkpoint reruns the forward's). Sequence
    parallelism's all-gather + reduce-scatter pairs send the same ring bytes. The embedding's, the output layer's and
    the loss's collectives are left out. Under context parallelism the activation is the rank's seq/cp tokens'."""
    count = math.ceil(shape.layers / lay.pp) * (4 + (2 if lay.recompute == "full" else 0))
    return count, "all_reduce", lay.micro_batch * shape.seq // lay.cp * shape.hidden * elem


def pp_messages(shape: ModelShape, lay: Layout, elem: int) -> tuple[int, str, float]:
    """Pipeline, per micro-batch on a middle stage's rank: one activation sent on and one gradient sent back per model
    chunk, each TP rank sending 1/tp of it with Megatron-LM's scatter/gather or sequence parallelism (each cp rank its
    seq/cp tokens)."""
    whole = lay.micro_batch * shape.seq // lay.cp * shape.hidden * elem
    return 2 * lay.chunks, "send", whole / (lay.tp if lay.sequence_parallel or lay.pp_scatter_gather else 1)


def dp_messages(shape: ModelShape, lay: Layout, elem: int) -> list[tuple[int, str, float]]:
    """Data parallel (over the dp·cp ranks of ``Layout.gradient_ranks``), per step on one rank, of its 1/(tp·pp) of
    every parameter it holds (under expert parallelism E/ep of each layer's experts, all-reduced with the rest):
    ZeRO 0–2 one all-reduce of the gradients (÷ the compression; cut into buckets for its time), ZeRO-3 per
    micro-batch and layer two all-gathers of the layer's weights (forward, backward) and one reduce-scatter of its
    gradients."""
    weights = (total_params(shape) - expert_parameters(shape, lay.ep)) / (lay.tp * lay.pp) * elem
    if lay.zero < 3:
        return [(1, "all_reduce", weights / lay.grad_compression)]
    layers = math.ceil(shape.layers / lay.pp)
    n = lay.micro_batches * layers
    return [(2 * n, "all_gather", weights / layers), (n, "reduce_scatter", weights / layers / lay.grad_compression)]

