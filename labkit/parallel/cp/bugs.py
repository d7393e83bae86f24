"""A zoo of known context-parallel bugs, each switched on for the length of a ``with`` block (notebook 12).

Each is a mistake that real implementations have made: the forward still returns numbers of the right shape and
a plausible size, training still runs, and only a check against one rank's attention
(:func:`labkit.parallel.cp.check.gradient_check`) shows it. The working code is never edited: a bug swaps in, for
the block, a wrong version of the one function it breaks.

* ``stale_kv`` — the ring's receive lands, but the step computes on the block it already had (a buffer reused
  before the transfer into it was waited for, or never swapped in): every rank attends to its own keys cp times.
* ``no_lse_rescale`` — the partials are merged without the exp(L_b − L) weights of the log-sum-exp merge: each
  block is normalised as if it held the whole row.
* ``mask_off_by_one_chunk`` — the causal mask compares a query chunk with the key chunks one place off: each
  query chunk sees the whole chunk after it (the future) and masks its own diagonal as if it were the next.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from labkit.parallel.cp import blocks, ring, sharding

BUGS = {
    "stale_kv": "the ring computes on the block it already had, not the one it received",
    "no_lse_rescale": "partials merged without the log-sum-exp weights exp(L_b − L)",
    "mask_off_by_one_chunk": "the causal mask one chunk off: each query chunk sees the next chunk",
}


def _merge_without_rescale(partial, out, lse):
    if partial is None:
        return out, lse
    return partial[0] + out, torch.logaddexp(partial[1], lse)  # the outputs simply added: wrong


def _pair_share_one_off(q_chunk: int, k_chunk: int, causal: bool) -> float:
    return sharding.pair_share(q_chunk + 1, k_chunk, causal)


class _StaleExchange:
    """The ring's comm module with an exchange whose received block is overwritten by the one that was sent."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def exchange(self, send_tensor, dst, recv_tensor, src, group=None, *, timer=None):
        work = self._comm.exchange(send_tensor, dst, recv_tensor, src, group, timer=timer)

        class Stale:
            def wait(_self):
                work.wait()
                recv_tensor.copy_(send_tensor)  # what arrived is dropped: the old block stays in hand
        return Stale()


@contextmanager
def bug(name: str):
    """Switch on the bug ``name`` (a key of :data:`BUGS`) inside the block; everything is put back after."""
    if name not in BUGS:
        raise ValueError(f"unknown context-parallel bug {name!r}: choose one of {', '.join(BUGS)}")
    module, attribute, wrong = {
        "stale_kv": (ring, "comm", _StaleExchange(ring.comm)),
        "no_lse_rescale": (blocks, "merge", _merge_without_rescale),
        "mask_off_by_one_chunk": (blocks, "pair_share", _pair_share_one_off),
    }[name]
    right = getattr(module, attribute)
    setattr(module, attribute, wrong)
    try:
        yield
    finally:
        setattr(module, attribute, right)
