"""What a collective costs on a catalog link, by the algorithms its library runs: NCCL's ring and (for the
all-reduce) its pipelined double binary tree, gloo's ring. A model, in the α–β terms of :mod:`labkit.comm.network`.

* **ring** — :func:`labkit.comm.network.collective_cost`'s ring (Patarasuk & Yuan 2009): an all-reduce of n bytes is
  2(p−1) rounds and 2(p−1)/p·n bytes through each rank; a reduce-scatter or an all-gather p−1 rounds and (p−1)/p·n.
* **tree** — NCCL's all-reduce on two binary trees (NCCL 2.4; Sanders, Speck & Träff 2009): the message is cut in
  two halves, each reduced up one tree and broadcast back down it in pipelined chunks, and the trees are built so
  that a rank that is an inner node of one is a leaf of the other. The busiest rank (an inner node with two
  children) sends n/2 up each tree and n/2 down to each of its two children: **2n bytes** (n at p = 2, where each
  tree is one edge). The chunks flow down the pipeline, so the rounds on the critical path are the trees' depth, up
  and down: **2⌈log₂ p⌉**. This is not the textbook binomial tree of :mod:`labkit.comm.network` (2⌈log₂ p⌉·n
  bytes: the whole message every round), which a real library does not run for large messages.

NCCL runs only the all-reduce on its trees (reduce-scatter and all-gather go round the ring), so a link's ``"tree"``
applies to the all-reduce alone; NCCL picks per message, and so does :func:`collective_seconds`, by the cheaper.
Left out: the pipeline's fill (a few chunks' time), NCCL's tuned per-algorithm bandwidths and its node-aware trees.
"""
from __future__ import annotations

from typing import Optional

from labkit.comm.network import Cost, ceil_log2, collective_cost, others_share
from labkit.sim.cluster import Link


def tree_all_reduce(nbytes: float, world: int) -> Cost:
    """NCCL's double binary tree all-reduce of ``nbytes`` over ``world`` ranks: 2⌈log₂ p⌉ rounds, 2n bytes through
    the busiest rank (n for two ranks)."""
    if world <= 1:
        return Cost(0, 0.0)
    return Cost(2 * ceil_log2(world), (1.0 if world == 2 else 2.0) * nbytes)


def gloo_cost(op: str, nbytes: float, world: int) -> Cost:
    """Rounds and bytes of ``op`` as gloo runs it: a ring for every reduction and gather, but an all-to-all posts a
    send and a receive to every peer at once and then waits for them all (gloo/alltoallv.cc): one round, the
    (p − 1)/p of the bytes that leave the rank."""
    if op == "all_to_all" and world > 1:
        return Cost(1, float(others_share(world)) * nbytes)
    return collective_cost(op, nbytes, world, "ring")


def algorithm_cost(op: str, nbytes: float, world: int, algorithm: str) -> Optional[Cost]:
    """Rounds and bytes of ``op`` by ``algorithm`` as a library runs it (NCCL's ``ring`` or ``tree``, or ``gloo``'s
    own choices, :func:`gloo_cost`); None where it does not (a tree but for the all-reduce)."""
    if algorithm == "tree":
        return tree_all_reduce(nbytes, world) if op == "all_reduce" else None
    if algorithm == "gloo":
        return gloo_cost(op, nbytes, world)
    return collective_cost(op, nbytes, world, algorithm)


def collective_seconds(op: str, nbytes: float, world: int, link: Link | None, efficiency: float) -> float:
    """rounds·α + bytes/(efficiency·β) of ``op`` on ``link`` by the cheapest of the link's algorithms (NCCL's ring or
    tree, as it picks per message; gloo's ring) — 0 for a group of one."""
    if link is None or world <= 1:
        return 0.0

    def seconds(cost: Cost) -> float:
        return cost.rounds * link.latency + cost.bytes / (efficiency * link.bandwidth)
    if op == "send":
        return seconds(collective_cost(op, nbytes, world))
    costs = [algorithm_cost(op, nbytes, world, algorithm) for algorithm in link.algorithms]
    return min(seconds(cost) for cost in costs if cost is not None)
