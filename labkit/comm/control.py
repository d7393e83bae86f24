"""What ranks say to each other that is not training traffic: uncounted, untimed, never held.

The collectives of :mod:`labkit.comm.collectives` are a technique's traffic: counted in wire bytes on a
``CommTimer``, timed, held by the emulated network and by a scheduled partition. Everything else ranks tell each
other goes through here, straight to the backend:

* waiting for each other (:func:`barrier`);
* rank 0 telling the others something: the run's start time, its configuration, the checkpoint to load
  (:func:`broadcast_tensor`, :func:`broadcast_object`);
* one number every rank agrees on: the slowest rank's timings, a gradient norm's sum of squares
  (:func:`max_over_ranks`, :func:`sum_over_ranks`; the norm's 8 bytes are left off the meters on purpose, they
  are not the gradients' traffic);
* a whole model put together from its parts to be saved (:func:`all_gather_tensors`, :func:`all_gather_objects`);
* calibration's probes (:func:`bare_collective`), bare because what they measure is the link itself.

Counting any of it would put bytes on the meters that no step of the technique sends; holding it on the emulated
link would slow bookkeeping down as if it were gradients. So nothing here takes a timer.

Each function looks its ``torch.distributed`` function up when called (the collectives capture theirs at import),
so whatever wraps ``torch.distributed`` for a while sees these calls: a dry run's recorder
(``labkit.sim.dryrun_record``, which names them "torch"), torch's FSDP2 instrumented by
:func:`labkit.comm.collectives.instrument_torch_collectives`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` (None: the world) has got here."""
    dist.barrier(group=group)


def broadcast_tensor(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s, in place on every rank; returns it."""
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object), on every rank; the others' ``obj`` is ignored."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def max_over_ranks(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every element replaced by its largest value over the ranks, in place; returns ``tensor``."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def sum_over_ranks(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every element replaced by its sum over the ranks, in place; returns ``tensor``."""
    dist.all_reduce(tensor, group=group)
    return tensor


def all_gather_tensors(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (all the same shape), in group-rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def all_gather_objects(obj: Any, group=None) -> list:
    """Every rank's ``obj`` (any picklable object), in group-rank order."""
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def bare_collective(op: str, full: torch.Tensor, part: torch.Tensor) -> Callable[[], None]:
    """A call of ``op`` on the default group, straight to the backend, for calibration to time: "all_reduce" of
    ``full``; "all_gather" of every rank's ``part`` into ``full``; "reduce_scatter" of ``full`` into ``part``;
    "send" of ``full`` from each even rank 2k to 2k + 1 (which receives it)."""
    rank = dist.get_rank()
    calls = {"all_reduce": lambda: dist.all_reduce(full),
             "all_gather": lambda: dist.all_gather_single(full, part),
             "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
             "send": lambda: dist.send(full, rank + 1) if rank % 2 == 0 else dist.recv(full, rank - 1)}
    return calls[op]
