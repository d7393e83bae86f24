"""Context parallelism: the sequence split across ranks, attention the one place they need each other's tokens.

Three ways to let every query see the keys it should, each in one file:

* :mod:`~labkit.parallel.cp.ring` — **ring attention** (Liu et al. 2023): key/value blocks passed round the ring,
  each step's transfer overlapped with the local block, results merged by log-sum-exp;
* :mod:`~labkit.parallel.cp.allgather` — **all-gather KV** (Llama 3's choice, Dubey et al. 2024): every rank
  gathers the whole K and V once, gradients reduce-scattered back;
* :mod:`~labkit.parallel.cp.ulysses` — **Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence shards
  into head shards, attention runs whole, a second all-to-all turns it back.

:mod:`~labkit.parallel.cp.sharding` says which part of the sequence a rank holds (contiguous, or the head-tail
split that balances causal work) and :mod:`~labkit.parallel.cp.blocks` is the block arithmetic they share.
"""
from labkit.parallel.cp.sharding import LAYOUTS, chunk_ids, positions, shard, unshard  # noqa: F401
from labkit.parallel.spec import CP_IMPLS

NATIVE = "native"  # parallel.cp.impl's torch implementation (torch.distributed.tensor.experimental.context_parallel)
VARIANTS = tuple(impl for impl in CP_IMPLS if impl != NATIVE)  # labkit's own, each in one file here


def attention(variant: str):
    """The context-parallel attention function ``f(q, k, v, group, layout, causal)`` of ``variant``."""
    if variant == "ring":
        from labkit.parallel.cp.ring import ring_attention as f
    elif variant == "allgather":
        from labkit.parallel.cp.allgather import allgather_attention as f
    elif variant == "ulysses":
        from labkit.parallel.cp.ulysses import ulysses_attention as f
    else:
        raise ValueError(f"unknown context-parallel variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    return f
