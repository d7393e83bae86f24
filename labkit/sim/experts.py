"""Mixtures of experts and expert parallelism in the step model: what the experts change in a step.

A model shape with experts (``ModelShape.experts`` > 0: every ``moe_every``-th block's MLP is E experts, each token
through ``top_k`` of them, :mod:`labkit.model.moe`) and a layout that spreads them over ``ep`` of the data-parallel
ranks (``Layout.ep``, labkit's ``parallel.ep.degree``: :mod:`labkit.parallel.ep`). What the step model then does
(:func:`labkit.sim.step.step_time`):

* **compute** — the FLOPs are the *active* parameters' (top-k experts a token; labkit's count,
  :func:`labkit.model.flops.flops_per_token`), the memory holds every expert: the dense parameters and E/ep of each
  layer's experts per rank (:func:`expert_parameters`);
* **ep comm** — per MoE layer and micro-batch, the dispatch and the combine all-to-alls forward, and both again
  backward (:func:`ep_messages`): each carries the rank's k·T routed rows of d values, (ep − 1)/ep of which leave
  it — the issue's 2·k·T·d·(ep − 1)/ep each way, what labkit's dispatch counts at the collective
  (tests/parallel/test_expert_parallel.py) — and, first, the expert counts (a call of a few bytes). Not overlapped:
  the expert computation waits for its rows;
* **imbalance** — a router is never perfectly even: with max/mean load b over the ep ranks
  (``Layout.expert_imbalance``, 1 at perfect balance: each rank's E/ep experts' rows together,
  :func:`rank_imbalance` of a step event's ``moe_load``; with one expert a rank, the experts' ``moe_max_mean``) the
  busiest rank's experts get b times the mean rows — b times the all-to-all bytes and b times the experts'
  compute — and every other rank waits for it at the next all-to-all (:func:`imbalance_flops_per_token`);
* **placement** — ep borrows the innermost dp ranks (:data:`labkit.parallel.mesh.AXES`: pp, dp, ep, cp, tp): an
  ep group is ep ranks tp·cp apart, inside a node while tp·cp·ep ≤ GPUs per node (:func:`ep_link`).

Simplifications, said once: the step model splits every block evenly over tp (labkit keeps an MoE layer whole on
each tp rank); the busiest stage holds ⌈MoE layers / pp⌉ of them; the shared expert is not modelled.
"""
from __future__ import annotations

import math

from labkit.sim.cluster import Cluster, Link
from labkit.sim.layout import Layout, ModelShape


def moe_layers(shape: ModelShape) -> int:
    """How many blocks' MLPs are mixtures of experts (0 for a dense shape)."""
    return shape.layers // shape.moe_every if shape.experts > 0 else 0


def mlp_parameters(shape: ModelShape) -> int:
    """One expert's parameters: a GPT MLP, d → 4d → d (no biases in a sim shape)."""
    return 8 * shape.hidden * shape.hidden


def expert_parameters(shape: ModelShape, ep: int = 1) -> int:
    """The expert parameters one rank does *not* hold under ``ep`` (its share is E/ep of each layer's): subtracted
    from the whole model's count for the memory a rank holds."""
    return moe_layers(shape) * shape.experts * mlp_parameters(shape) * (ep - 1) // ep


def stage_moe_layers(shape: ModelShape, lay: Layout) -> int:
    """The MoE layers the busiest pipeline stage holds."""
    return math.ceil(moe_layers(shape) / lay.pp)


EP_CALLS_PER_LAYER = 5  # labkit's all-to-alls a MoE layer and micro-batch: the counts, the dispatch and the combine
#                        forward; the combine's and the dispatch's gradients backward (labkit.parallel.ep.dispatch)


def ep_messages(shape: ModelShape, lay: Layout, elem: int) -> list[tuple[int, str, float]]:
    """The ep all-to-alls of one micro-batch on the busiest rank, (count, "all_to_all", bytes): 4 a MoE layer carrying
    rows (dispatch and combine, forward and backward), each of the rank's k·T rows × d values × the imbalance (the
    all-to-all's ring factor (ep − 1)/ep makes them the bytes that leave it), and 1 a MoE layer carrying the counts
    exchanged first (E int64: a few bytes, but a call, and on a latency-bound link a call is what costs).
    :data:`EP_CALLS_PER_LAYER` calls a layer in all. None at ep = 1."""
    if lay.ep == 1 or moe_layers(shape) == 0:
        return []
    tokens = lay.micro_batch * shape.seq / lay.cp
    rows = shape.top_k * tokens * lay.expert_imbalance
    layers = stage_moe_layers(shape, lay)
    return [(4 * layers, "all_to_all", rows * shape.hidden * elem), (layers, "all_to_all", 8 * shape.experts)]


def ep_calls(shape: ModelShape, lay: Layout) -> int:
    """How many all-to-alls the busiest rank issues on the ep axis per micro-batch (0 at ep = 1)."""
    return sum(n for n, _, _ in ep_messages(shape, lay, 4))


def balanced_ep_bytes(shape: ModelShape, lay: Layout, elem: int = 4) -> float:
    """What one rank sends per step on the ep axis: the wire bytes of :func:`ep_messages` (the rows and the counts)
    over the micro-batches. At ``Layout.expert_imbalance`` 1, a perfectly even router: the formula a run's counted
    bytes are set beside (a stage's MoE layers: the busiest stage's)."""
    from labkit.comm.collectives import wire_exact  # lazy: it imports torch

    return float(lay.micro_batches * sum(n * wire_exact(op, round(nbytes), lay.ep)
                                         for n, op, nbytes in ep_messages(shape, lay, elem)))


def rank_imbalance(load: list[float], ep: int) -> float:
    """Max/mean rows over ``ep`` ranks that hold the experts in equal contiguous blocks (labkit's
    :func:`labkit.parallel.ep.keep_experts`), from the rows each expert got (``load``, a step event's ``moe_load`` of
    one layer). 1 at ep = 1 (one rank holds them all) or with no rows."""
    if ep <= 1 or not sum(load):
        return 1.0
    part = len(load) // ep
    blocks = [sum(load[i * part:(i + 1) * part]) for i in range(ep)]
    return max(blocks) / (sum(blocks) / ep)


def ep_link(cluster: Cluster, lay: Layout) -> Link | None:
    """The link of an ep group: ep ranks tp·cp apart (the mesh's pp, dp, ep, cp, tp order); None for ep = 1."""
    return cluster.link_for(lay.tp * lay.cp, lay.ep)


def imbalance_flops_per_token(shape: ModelShape, lay: Layout) -> float:
    """The FLOPs per token the busiest rank's experts add over the mean's: (b − 1) × the experts' share of the
    training FLOPs (6 × k × one expert's parameters a MoE layer). Under ep a rank's experts serve the whole ep
    group's tokens, so a hot expert slows its rank; with ep = 1 every rank holds every expert and the imbalance
    costs nothing (the grouped matmul runs the same rows)."""
    if lay.ep == 1 or moe_layers(shape) == 0:
        return 0.0
    return (lay.expert_imbalance - 1) * 6 * shape.top_k * mlp_parameters(shape) * stage_moe_layers(shape, lay) * lay.pp


def ep_problems(shape: ModelShape, lay: Layout) -> list[str]:
    """What labkit's trainer refuses of this layout's expert parallelism (:mod:`labkit.parallel.ep.checks`), in its
    words, and an imbalance below perfect balance."""
    found = []
    if lay.ep > 1 and shape.experts <= 0:
        found.append(f"ep={lay.ep} spreads the experts of a mixture of experts over ranks: the shape has none")
    elif lay.ep > 1 and shape.experts % lay.ep:
        found.append(f"ep={lay.ep}: {shape.experts} experts are not divisible by it")
    if lay.dp % lay.ep:
        found.append(f"ep={lay.ep} must divide the data-parallel ranks it borrows (dp={lay.dp})")
    if lay.expert_imbalance < 1:
        found.append(f"expert_imbalance is max/mean load, >= 1 (1: perfect balance), got {lay.expert_imbalance}")
    return found
