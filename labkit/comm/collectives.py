"""The communication layer: the one place labkit launches collectives.

Going through one place is what makes communication *measurable*: every collective here is
timed from launch to completion and counted in **wire bytes** — what one rank sends (and, by
symmetry, receives) under the bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009):

* all-reduce of n bytes over p ranks: a reduce-scatter then an all-gather, 2·(p−1)/p · n;
* all-gather into n output bytes, or reduce-scatter of n input bytes: (p−1)/p · n each;
* broadcast of n bytes: n (the root sends it, everyone else receives it).

That is why an all-reduce costs about twice the model size per step no matter how many ranks
there are, and why ZeRO-3 (two all-gathers and one reduce-scatter) costs about 1.5× of it.

torch's own data-parallel engines call collectives from C++ (DDP) or from deep inside FSDP2;
:func:`instrument_torch_collectives` routes FSDP2's calls through the same counting wrappers, and
DDP reports through a communication hook (:func:`timed_allreduce_hook`).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

from labkit.comm import network, partition
from labkit.metrics.timers import CommTimer

# The real functions, captured before anything can instrument them.
_all_reduce = dist.all_reduce
_all_gather_single = dist.all_gather_single
_reduce_scatter_single = dist.reduce_scatter_single
_broadcast = dist.broadcast


def _hold_if_partitioned() -> None:
    """A rank cut off by a scheduled partition (``labkit.comm.partition``) waits here until it heals."""
    faults = partition.current()
    if faults.window is not None:
        faults.hold(dist.get_rank())


def wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for ``op`` on ``nbytes`` (see the module docstring)."""
    if world <= 1:
        return 0
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
              "reduce_scatter": (world - 1) / world, "broadcast": 1.0}[op]
    return int(factor * nbytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _HeldWork:
    """An async collective whose completion is held for the emulated network's time."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> bool:
        self._future.wait()
        return True


def _finish(work, timer: CommTimer, start: float, async_op: bool, wire: int):
    """Record completion now (blocking call) or when the backend finishes (async call).

    With an emulated network (``labkit.comm.network``) completion is held until α + n/β after the
    launch; the hold happens on the backend's completion thread for async calls, so the caller
    keeps computing meanwhile — communication still overlaps compute, as it would on a real link.
    """
    if not async_op:
        network.hold_until(start, wire)
        timer.completed(start)
        return None

    def complete(fut):
        network.hold_until(start, wire)
        timer.completed(start)
        return fut.value()

    return _HeldWork(work.get_future().then(complete))


def all_reduce(tensor, timer: CommTimer, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _hold_if_partitioned()
    wire = wire_bytes("all_reduce", _nbytes(tensor), dist.get_world_size(group))
    start = timer.launched(wire)
    return _finish(_all_reduce(tensor, op=op, group=group, async_op=async_op), timer, start, async_op, wire)


def all_gather(output, input, timer: CommTimer, group=None, async_op=False):
    """Concatenate every rank's ``input`` into ``output`` (rank order)."""
    _hold_if_partitioned()
    wire = wire_bytes("all_gather", _nbytes(output), dist.get_world_size(group))
    start = timer.launched(wire)
    return _finish(_all_gather_single(output, input, group=group, async_op=async_op), timer, start, async_op, wire)


def reduce_scatter(output, input, timer: CommTimer, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Sum ``input`` over ranks; rank r keeps the r-th equal slice in ``output``."""
    _hold_if_partitioned()
    wire = wire_bytes("reduce_scatter", _nbytes(input), dist.get_world_size(group))
    start = timer.launched(wire)
    work = _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return _finish(work, timer, start, async_op, wire)


def broadcast(tensor, src: int, timer: CommTimer, group=None):
    _hold_if_partitioned()
    wire = wire_bytes("broadcast", _nbytes(tensor), dist.get_world_size(group))
    start = timer.launched(wire)
    _broadcast(tensor, src=src, group=group)
    network.hold_until(start, wire)
    timer.completed(start)


def send(tensor: torch.Tensor, dst: int, timer: CommTimer) -> None:
    """Point-to-point: send ``tensor`` to rank ``dst`` (held while this rank is partitioned)."""
    _hold_if_partitioned()
    start = timer.launched(_nbytes(tensor))
    dist.send(tensor, dst)
    network.hold_until(start, _nbytes(tensor))
    timer.completed(start)


def recv(tensor: torch.Tensor, timer: CommTimer, src=None) -> int:
    """Point-to-point: receive into ``tensor`` from ``src`` (None: whoever sends first); returns the sender.

    A message that arrives while this rank is partitioned is delivered when the partition heals.
    """
    start = timer.launched(0)
    sender = dist.recv(tensor, src)
    _hold_if_partitioned()
    timer.completed(start)
    return sender


def timed_all_reduce_mean(tensor: torch.Tensor, timer: CommTimer, group=None) -> torch.futures.Future:
    """Asynchronously all-reduce ``tensor`` in place and divide by the world size.

    Returns a future whose value is the averaged tensor.
    """
    world = dist.get_world_size(group)
    timer.grad_ready()
    work = all_reduce(tensor, timer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


def timed_allreduce_hook(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: torch's plain averaging all-reduce, timed and counted."""
    return timed_all_reduce_mean(bucket.buffer(), timer)


@contextmanager
def instrument_torch_collectives(timer: CommTimer):
    """Count and time the all-gathers and reduce-scatters that torch's FSDP2 issues."""

    def counted_all_gather(output, input, group=None, async_op=False):
        return all_gather(output, input, timer, group=group, async_op=async_op)

    def counted_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return reduce_scatter(output, input, timer, op=op, group=group, async_op=async_op)

    dist.all_gather_single, dist.reduce_scatter_single = counted_all_gather, counted_reduce_scatter
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = _all_gather_single, _reduce_scatter_single
