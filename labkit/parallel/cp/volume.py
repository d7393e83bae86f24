"""What each context-parallel variant sends per rank per attention layer, in wire bytes, and what it keeps for
backward: the analytic counts the tests and the benchmark hold the counted bytes (``CommTimer``, at the collective;
``count_saved_bytes``, at autograd's saved-tensor hooks) against.

``block_bytes``: one of q, k or v on one rank — batch × heads × local sequence × head dim × element size.
"""
from __future__ import annotations

from labkit.comm.collectives import wire_bytes
from labkit.parallel.cp.sharding import imbalance


def cp_wire_bytes(variant: str, cp: int, block_bytes: int) -> dict[str, int]:
    """Bytes one rank sends in the forward and in the backward of one attention call."""
    kv = 2 * block_bytes  # k and v travel together
    if cp <= 1:
        return {"forward": 0, "backward": 0}
    if variant == "ring":  # cp − 1 blocks passed on; backward: the block and its gradients, and their last hop home
        return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + cp * kv}
    if variant == "allgather":  # one all-gather of K and V; backward one reduce-scatter of their gradients
        gathered = wire_bytes("all_gather", cp * kv, cp)
        return {"forward": gathered, "backward": wire_bytes("reduce_scatter", cp * kv, cp)}
    if variant == "ulysses":  # q, k, v to head shards and the output back; backward the same four, reversed
        four = 4 * wire_bytes("all_to_all", block_bytes, cp)
        return {"forward": four, "backward": four}
    raise ValueError(f"unknown context-parallel variant {variant!r}")


def cp_saved_bytes(variant: str, cp: int, block_bytes: int, lse_bytes: int) -> int:
    """Bytes one rank's attention call keeps for backward, q, k and v its own tensors: q, k, v, the output and the
    log-sum-exp (``lse_bytes``: heads × local sequence × 4) — a one-rank call's ÷ cp; all-gather KV keeps the whole
    sequence's k and v in place of its own, cp times as many. Ulysses keeps h ÷ cp heads of every token: the same
    bytes as the ring."""
    kv = (cp if variant == "allgather" and cp > 1 else 1) * 2 * block_bytes
    if variant not in ("ring", "allgather", "ulysses"):
        raise ValueError(f"unknown context-parallel variant {variant!r}")
    return 2 * block_bytes + kv + lse_bytes


def cp_imbalance(variant: str, cp: int, layout: str, causal: bool = True, diagonal: float = 0.5) -> float:
    """max/mean of the ranks' attention work: the ring and the all-gather attend each rank's own query chunks (the
    layout decides, :func:`.sharding.imbalance`); Ulysses attends whole sequences of cp's share of the heads, even
    whatever the layout. ``diagonal``: as in :func:`.sharding.rank_work`."""
    return 1.0 if variant == "ulysses" else imbalance(cp, layout, causal, diagonal)
