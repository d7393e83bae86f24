"""Context parallelism in the step model: what cp changes in a step, every fact taken from where labkit writes it.

A layout with ``cp`` > 1 cuts each sequence into cp parts (``Layout.cp_layout``: head-tail or contiguous chunks,
:mod:`labkit.parallel.cp.sharding`). What the step model then does (:func:`labkit.sim.step.step_time`):

* **tokens** — each rank holds micro_batch·seq/cp of them: the FLOPs, the elementwise kernels, the tp all-reduces
  and the pipeline's activations divide by cp, and so do the activations kept
  (:func:`labkit.memory_estimate.activation_bytes_per_layer`'s ``cp``). Every query still meets every earlier key,
  so a token's attention FLOPs are those of the whole sequence.
* **causal imbalance** — the attention core's FLOPs (and the naive scores' memory traffic) are those of the busiest
  cp rank: the mean × :func:`labkit.parallel.cp.volume.cp_imbalance` ((2·cp − 1)/cp contiguous, 1 head-tail and
  Ulysses) (:func:`attention_imbalance`).
* **cp comm** — per layer, forward and backward (the forward again under selective or full recompute, whose
  checkpoint reruns the attention), the bytes :func:`labkit.parallel.cp.volume.cp_wire_bytes` says one rank sends,
  carried by the collectives of :data:`LAUNCHES` (:func:`cp_messages`): that is all this module adds, the
  launches (for the latency term and the algorithm), never the bytes. Not overlapped with compute (the ring's
  transfer of the next block behind the block in hand is left out: an upper bound on its cost).
* **placement** — the mesh's order is pp, dp, cp, tp (:data:`labkit.parallel.mesh.AXES`, dp as two;
  Megatron-LM's tp-cp-dp-pp, innermost first, is the same): a cp group is cp ranks ``tp`` apart, inside a node
  while tp·cp ≤ GPUs per node
  (:func:`cp_link`).
* **gradients** — the ranks of a dp × cp group hold the same parameters: the data-parallel all-reduce (or ZeRO's
  sharding) runs over dp·cp of them, tp apart (``Layout.gradient_ranks``, the trainer's ``dp_cp`` axis).

What the trainer refuses, the step model refuses with the trainer's words (:func:`cp_problems`).
"""
from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

from labkit.sim.cluster import Cluster, Link
from labkit.sim.layout import Layout, ModelShape

# Which collectives carry each variant's bytes in one attention call, and how many launches: (op, launches(cp)). The
# ring passes cp − 1 key/value blocks forward; backward passes the block cp − 1 times and its gradients cp times (the
# last hop home: labkit.parallel.cp.ring); the all-gather variant gathers once, reduce-scatters once; Ulysses sends
# q, k, v and the output through four all-to-alls each way (labkit.parallel.cp.ulysses).
LAUNCHES = {
    "ring": {"forward": ("send", lambda cp: cp - 1), "backward": ("send", lambda cp: 2 * cp - 1)},
    "allgather": {"forward": ("all_gather", lambda cp: 1), "backward": ("reduce_scatter", lambda cp: 1)},
    "ulysses": {"forward": ("all_to_all", lambda cp: 4), "backward": ("all_to_all", lambda cp: 4)},
}


def block_bytes(shape: ModelShape, lay: Layout, elem: int) -> int:
    """One of q, k or v on one rank, one micro-batch (``cp_wire_bytes``' ``block_bytes``): micro_batch × heads/tp ×
    seq/cp × head dim × element size."""
    return lay.micro_batch * (shape.heads // lay.tp) * (shape.seq // lay.cp) * (shape.hidden // shape.heads) * elem


def layer_wire_bytes(shape: ModelShape, lay: Layout, elem: int) -> dict[str, int]:
    """Bytes one rank sends in one attention layer, one micro-batch: :func:`labkit.parallel.cp.volume.cp_wire_bytes`
    ({"forward", "backward"}; 0 at cp = 1)."""
    from labkit.parallel.cp.volume import cp_wire_bytes  # lazy: it imports torch

    return cp_wire_bytes(lay.cp_impl, lay.cp, block_bytes(shape, lay, elem))


def forward_passes(lay: Layout) -> int:
    """How many times a layer's attention forward runs per micro-batch: twice under recompute (selective
    checkpoints the attention, full the whole block; either reruns the cp collectives before the backward)."""
    return 1 if lay.recompute == "none" else 2


def cp_messages(shape: ModelShape, lay: Layout, elem: int) -> list[tuple[int, str, Fraction]]:
    """Context parallel, per micro-batch on one rank of a stage of ⌈L/pp⌉ layers: (how many, the collective, the
    bytes of each), forward then backward. Each message's size is :func:`layer_wire_bytes`' bytes over its launches
    and the collective's wire factor (:data:`labkit.comm.collectives.WIRE_FACTOR`), so that their wire bytes add up to
    ``cp_wire_bytes`` exactly. Empty at cp = 1."""
    from labkit.comm.collectives import WIRE_FACTOR

    if lay.cp == 1:
        return []
    layers, wire = math.ceil(shape.layers / lay.pp), layer_wire_bytes(shape, lay, elem)
    out = []
    for direction, passes in (("forward", forward_passes(lay)), ("backward", 1)):
        op, launches = LAUNCHES[lay.cp_impl][direction]
        n = launches(lay.cp)
        out.append((passes * layers * n, op, Fraction(wire[direction]) / n / WIRE_FACTOR[op](lay.cp)))
    return out


def attention_imbalance(lay: Layout) -> float:
    """The busiest cp rank's attention work over the mean: :func:`labkit.parallel.cp.volume.cp_imbalance` for the
    layout's variant and chunking, causal (a GPT), the diagonal blocks counted as the FLOPs a kernel that skips
    masked tiles does. 1 at cp = 1."""
    if lay.cp == 1:
        return 1.0
    from labkit.parallel.cp.volume import cp_imbalance

    return cp_imbalance(lay.cp_impl, lay.cp, lay.cp_layout)


def cp_link(cluster: Cluster, lay: Layout) -> Link | None:
    """The link of a cp group: cp ranks tp apart (the mesh's pp, dp, cp, tp order); None for cp = 1."""
    return cluster.link_for(lay.tp, lay.cp)


def cp_problems(shape: ModelShape, lay: Layout) -> list[str]:
    """What the trainer refuses of this layout's context parallelism, in its words: a variant or chunking it does not
    know (:data:`labkit.parallel.spec.CP_IMPLS`, ``CP_LAYOUTS``), then
    :func:`labkit.parallel.layout_checks.context_problems` on a config holding the layout's cp, tp and sequence
    parallelism and the shape's sequence length and heads. The knobs the step model does not have are set to what
    the trainer takes (attention backend sdpa, no dropout, labkit's tensor parallelism, fp32: the trainer's
    bf16 refusal is about its CPU kernels' merge precision, and the step model costs the cluster's own precision)."""
    from labkit.parallel.spec import CP_IMPLS, CP_LAYOUTS  # lazy: labkit.parallel imports torch

    if lay.cp_impl not in CP_IMPLS or lay.cp_layout not in CP_LAYOUTS:
        return [f"cp_impl must be one of {CP_IMPLS} and cp_layout one of {CP_LAYOUTS} (parallel.cp.impl and "
                f"parallel.cp.layout), got {lay.cp_impl!r}, {lay.cp_layout!r}"]
    if lay.cp == 1:
        return []
    from labkit.parallel.layout_checks import context_problems

    cfg = SimpleNamespace(
        parallel=SimpleNamespace(cp=SimpleNamespace(degree=lay.cp, impl=lay.cp_impl, layout=lay.cp_layout),
                                 tp=SimpleNamespace(degree=lay.tp, sequence_parallel=lay.sequence_parallel,
                                                    impl="labkit")),
        model=SimpleNamespace(block_size=shape.seq, n_head=shape.heads, dropout=0.0),
        attention=SimpleNamespace(backend="sdpa"), precision=SimpleNamespace(mode="fp32"))
    return context_problems(cfg)
