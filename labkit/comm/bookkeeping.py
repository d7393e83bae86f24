"""Collectives that are not training traffic: the loop's own bookkeeping, uncounted.

Everything else in :mod:`labkit.comm` counts and times what it moves, because that traffic is what training
costs. These calls are the loop measuring and agreeing with itself, between steps and outside the timed step:
every rank's measurements gathered for the step event (:mod:`labkit.metrics.step_meter`), rank 0's device peak
shared once at the start (:mod:`labkit.run_facts`), the validation losses summed (``Trainer.evaluate``). No
timer sees them, so a step's ``comm_bytes`` and ``comm_s`` stay what training moved.

Each calls ``torch.distributed`` as it is when it runs: an instrumented function (FSDP2's, which passes these
groups through uncounted) or a dry run's recorder sees them as it saw the direct calls they replace.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor, group=None) -> None:
    """Sum ``tensor`` in place over ``group`` (None: the world)."""
    dist.all_reduce(tensor, group=group)


def broadcast_object(obj, src: int = 0):
    """``src``'s ``obj`` on every rank (pickled: small things only); the other ranks' ``obj`` is ignored."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj, group=None) -> list:
    """Every member's ``obj`` of ``group`` (None: the world), in rank order, on each of them (pickled)."""
    table = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, obj, group=group)
    return table
