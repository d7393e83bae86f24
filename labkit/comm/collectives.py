"""The communication layer: the one place labkit launches collectives (what ranks say to each other that is not
training traffic, uncounted and untimed, goes through :mod:`labkit.comm.control`).

Going through one place is what makes communication *measurable*: every collective here is
timed from launch to completion (on CUDA tensors with CUDA events: ``labkit.metrics.timers``) and
counted in **wire bytes** — what one rank sends (and, by symmetry, receives) under the
bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009):

* all-reduce of n bytes over p ranks: a reduce-scatter then an all-gather, 2·(p−1)/p · n;
* all-gather into n output bytes, or reduce-scatter of n input bytes: (p−1)/p · n each;
* broadcast of n bytes: n (the root sends it, everyone else receives it);
* a point-to-point send of n bytes: n; receiving sends nothing.

That is why an all-reduce costs about twice the model size per step no matter how many ranks
there are, and why ZeRO-3 (two all-gathers and one reduce-scatter) costs about 1.5× of it.
These factors are written once, as exact fractions, in :data:`WIRE_FACTOR`: the counters here,
the tensor-parallel volumes (``labkit.parallel.tp.volume``) and the dry run's analytic counts
(``labkit.sim.dryrun_counts``) all read it.

torch's own data-parallel engines call collectives from C++ (DDP) or from deep inside FSDP2;
:func:`instrument_torch_collectives` routes FSDP2's calls through the same counting wrappers, and
DDP reports through a communication hook (:func:`timed_allreduce_hook`).
"""
import math
from contextlib import contextmanager
from fractions import Fraction
from typing import Callable

import torch
import torch.distributed as dist

from labkit.comm import network, partition
from labkit.comm.axes import AxisGroup, process_group, timer_for
from labkit.comm.network import others_share
from labkit.metrics.timers import CommTimer

# The real functions, captured before anything can instrument them.
_all_reduce = dist.all_reduce
_all_gather_single = dist.all_gather_single
_reduce_scatter_single = dist.reduce_scatter_single
_broadcast = dist.broadcast
_all_to_all_single = dist.all_to_all_single


def _hold_if_partitioned() -> None:
    """A rank cut off by a scheduled partition (``labkit.comm.partition``) waits here until it heals."""
    faults = partition.current()
    if faults.window is not None:
        faults.hold(dist.get_rank())


# Bytes one rank sends per byte of the collective's size, over a group of p ranks, exactly (the ring
# formulas of the module docstring; ``others_share(p)`` is (p−1)/p, the part one pass round the ring moves).
WIRE_FACTOR: dict[str, Callable[[int], Fraction]] = {
    "all_reduce": lambda p: 2 * others_share(p),  # a reduce-scatter, then an all-gather: two passes
    "reduce_scatter": others_share,
    "all_gather": others_share,
    "all_to_all": others_share,  # each rank keeps its own 1/p and sends the rest, a chunk to each other rank
    "all_to_all_v": lambda p: Fraction(1),  # uneven chunks (expert parallelism): its size is what goes to the others
    "broadcast": lambda p: Fraction(1),  # the root sends the whole tensor once
    "send": lambda p: Fraction(1),  # point to point (p = 2: the pair)
    "recv": lambda p: Fraction(0),  # the sender counts the bytes
}


def wire_exact(op: str, nbytes: int, world: int) -> Fraction:
    """Bytes one rank sends for ``op`` on ``nbytes`` over ``world`` ranks, as an exact fraction (0 alone)."""
    if world <= 1:
        return Fraction(0)
    return WIRE_FACTOR[op](world) * nbytes


def wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for ``op`` on ``nbytes``, counted in whole bytes: the floor of the exact product,
    taken once per call (each call is one transfer). Integer arithmetic throughout, so no size is off by
    one from float rounding: ``wire_bytes("all_gather", n, p)`` is ⌊(p−1)·n/p⌋ for every n."""
    return math.floor(wire_exact(op, nbytes, world))


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


def _finish(work, timer: CommTimer, start: float, async_op: bool, op: str, nbytes: int, world: int):
    """Record completion now (blocking call) or when the backend finishes (async call).

    With an emulated network (``labkit.comm.network``) completion is held until ``op`` on ``nbytes`` over
    ``world`` ranks is done on the process's emulated link (its algorithm's rounds·α + bytes/β, after the
    collectives launched before it: :func:`labkit.comm.network.reserve`);
    the hold happens on the backend's completion thread for async calls, so the caller keeps
    computing meanwhile — communication still overlaps compute, as it would on a real link.

    On CUDA tensors ``timer.completed`` records the end as a CUDA event on the stream current where it
    is called (``labkit.metrics.timers``): after a blocking call, the caller's stream, which the backend's
    ``wait()`` has made wait on the collective; in the callback, the stream torch runs ``then`` callbacks
    on, synchronised with the collective's kernels. So the end is when the collective *ran*, not when
    NCCL completed its future (at enqueue). (``_WaitedWork``'s thread records it on that thread's current
    stream after ``work.wait()``: ordered after the collective too, gloo's CUDA reduce-scatter only.)
    """
    due = network.reserve(start, op, nbytes, world)  # now, in launch order: the link serves them in turn
    if not async_op:
        network.wait_until(due)
        timer.completed(start)
        return None

    def complete(fut):
        network.wait_until(due)
        timer.completed(start)
        return fut.value()

    try:
        future = work.get_future()
    except RuntimeError:  # gloo's async reduce-scatter has no future: a thread waits for it instead
        return _WaitedWork(work, lambda: complete(_DoneWork(None).get_future()))
    return _HeldWork(future.then(complete))


class _WaitedWork:
    """An async collective without a future: a thread blocks in its ``wait`` (releasing the GIL, so the caller
    keeps computing) and stamps the completion the moment the backend finishes."""

    def __init__(self, work, on_done):
        import threading

        self._thread = threading.Thread(target=lambda: (work.wait(), on_done()), daemon=True)
        self._thread.start()

    def wait(self) -> bool:
        self._thread.join()
        return True


class _DoneWork:
    """A collective over a group of one: its result is already in place."""

    def __init__(self, result):
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> bool:
        return True


def _launch(collective, world: int, result, async_op: bool, *args, **kwargs):
    """Start ``collective`` on the backend, unless the group has one rank: then there is nothing to send and
    the backend is not asked. (Asking wakes its thread for nothing; on a small CPU that thread preempts one
    of the compute threads mid-backward, and the whole thread team waits for it: ``benchmarks/overhead.py``
    measures the single-process trainer against a bare loop.)"""
    if world > 1:
        return collective(*args, async_op=async_op, **kwargs)
    return _DoneWork(result) if async_op else None


def all_reduce(tensor, group: AxisGroup | None = None, op=dist.ReduceOp.SUM, async_op=False, *,
               timer: CommTimer | None = None):
    """Sum (``op``) ``tensor`` over ``group``'s ranks, in place. Counted on ``timer``, else on the timer the step
    set for ``group``'s axis (:mod:`labkit.comm.axes`); so is every collective here."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    world = dist.get_world_size(group)
    wire = wire_bytes("all_reduce", _nbytes(tensor), world)
    start = timer.launched(wire, tensor)
    work = _launch(_all_reduce, world, [tensor], async_op, tensor, op=op, group=group)
    return _finish(work, timer, start, async_op, "all_reduce", _nbytes(tensor), world)


def all_gather(output, input, group: AxisGroup | None = None, async_op=False, *, timer: CommTimer | None = None):
    """Concatenate every rank's ``input`` into ``output`` (rank order)."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    world = dist.get_world_size(group)
    wire = wire_bytes("all_gather", _nbytes(output), world)
    start = timer.launched(wire, output)
    if world == 1:
        output.copy_(input.reshape(output.shape))
    work = _launch(_all_gather_single, world, [output], async_op, output, input, group=group)
    return _finish(work, timer, start, async_op, "all_gather", _nbytes(output), world)


def reduce_scatter(output, input, group: AxisGroup | None = None, op=dist.ReduceOp.SUM, async_op=False, *,
                   timer: CommTimer | None = None):
    """Sum ``input`` over ranks; rank r keeps the r-th equal slice in ``output``."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    world = dist.get_world_size(group)
    wire = wire_bytes("reduce_scatter", _nbytes(input), world)
    start = timer.launched(wire, input)
    if world == 1:
        output.copy_(input.reshape(output.shape))
    work = _launch(_reduce_scatter_single, world, [output], async_op, output, input, op=op, group=group)
    return _finish(work, timer, start, async_op, "reduce_scatter", _nbytes(input), world)


def all_to_all(output, input, group: AxisGroup | None = None, *, timer: CommTimer | None = None,
               output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None):
    """Cut ``input`` into p equal chunks along dim 0 and send chunk j to rank j; ``output``'s chunk j is what rank
    j sent here (Ulysses' re-sharding: sequence-sharded ↔ head-sharded). With split sizes the chunks are uneven:
    ``input_split_sizes[j]`` rows go to rank j, ``output_split_sizes[j]`` come from it (expert parallelism's
    dispatch); the bytes counted are those that leave this rank, every row but the ones it sends itself."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    world = dist.get_world_size(group)
    if input_split_sizes is None:
        sent, size = wire_bytes("all_to_all", _nbytes(input), world), _nbytes(input)
    else:  # uneven: exact bytes to the others; the emulated link moves them as a pairwise all-to-all would
        sent = wire_bytes("all_to_all_v", uneven_sent_bytes(input, input_split_sizes, group), world)
        size = math.ceil(sent * world / (world - 1)) if world > 1 else 0  # (p−1)/p of it is what one rank sends
    start = timer.launched(sent, input)
    if world == 1:
        output.copy_(input)
    work = _launch(_all_to_all_single, world, None, False, output, input, group=group,
                   output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes)
    return _finish(work, timer, start, False, "all_to_all", size, world)


def uneven_sent_bytes(input: torch.Tensor, input_split_sizes: list[int], group) -> int:
    """The bytes of ``input``'s rows that an uneven all-to-all sends to the other ranks (all but this rank's own
    chunk, ``input_split_sizes[its rank in group]`` rows)."""
    if dist.get_world_size(group) == 1:
        return 0
    row = _nbytes(input) // max(1, input.size(0))
    return row * (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)])


def exchange(send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int,
             group: AxisGroup | None = None, *, timer: CommTimer | None = None) -> "_Exchange":
    """One step round a ring: start sending ``send_tensor`` to group rank ``dst`` while receiving ``recv_tensor``
    from group rank ``src``, and return at once (the caller computes meanwhile; ``wait()`` before reading
    ``recv_tensor`` or writing ``send_tensor``). Counts the bytes sent."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    start = timer.launched(_nbytes(send_tensor), send_tensor)
    works = [dist.isend(send_tensor, group=group, group_dst=dst), dist.irecv(recv_tensor, group=group, group_src=src)]
    return _Exchange(works, timer, start, _nbytes(send_tensor), dist.get_world_size(group))


class _Exchange:
    def __init__(self, works, timer: CommTimer, start: float, nbytes: int, world: int):
        self.works, self.timer, self.start = works, timer, start
        self.due = network.reserve(start, "send", nbytes, world)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        network.wait_until(self.due)
        self.timer.completed(self.start)


def broadcast(tensor, src: int, group: AxisGroup | None = None, *, timer: CommTimer | None = None):
    """Rank ``src``'s ``tensor`` (a global rank) into every rank's, in place."""
    _hold_if_partitioned()
    timer, group = timer_for(group, timer), process_group(group)
    world = dist.get_world_size(group)
    wire = wire_bytes("broadcast", _nbytes(tensor), world)
    start = timer.launched(wire, tensor)
    _launch(_broadcast, world, [tensor], False, tensor, src=src, group=group)
    network.hold_until(start, "broadcast", _nbytes(tensor), world)
    timer.completed(start)


def send(tensor: torch.Tensor, dst: int, group: AxisGroup | None = None, *, timer: CommTimer | None = None) -> None:
    """Point-to-point: send ``tensor`` to global rank ``dst`` (held while this rank is partitioned); ``group``, the
    axis the pair is on, says which timer counts it."""
    _hold_if_partitioned()
    timer = timer_for(group, timer)
    start = timer.launched(_nbytes(tensor), tensor)
    dist.send(tensor, dst)
    network.hold_until(start, "send", _nbytes(tensor), dist.get_world_size())
    timer.completed(start)


def recv(tensor: torch.Tensor, src=None, group: AxisGroup | None = None, *, timer: CommTimer | None = None) -> int:
    """Point-to-point: receive into ``tensor`` from global rank ``src`` (None: whoever sends first); returns the
    sender.

    A message that arrives while this rank is partitioned is delivered when the partition heals.
    """
    timer = timer_for(group, timer)
    start = timer.launched(0, tensor)
    sender = dist.recv(tensor, src)
    _hold_if_partitioned()
    timer.completed(start)
    return sender


def isend(tensor: torch.Tensor, dst: int, group: AxisGroup | None = None, *, timer: CommTimer | None = None):
    """Point-to-point, asynchronous: start sending ``tensor`` to rank ``dst`` and return the backend's work at once
    (``wait()`` on it before ``tensor`` is written or freed). Counted at launch, taking no time on ``timer``: the
    send runs behind the sender's compute, and the receiver's :func:`irecv` times the wait for it.

    A pipeline's schedules need this (``labkit.parallel.pp.pipeline``): a blocking send on gloo returns only once
    the receiver has asked, so two neighbours each sending first would wait for each other for ever. Unlike
    :func:`send` it is not held by the emulated network or a partition."""
    timer = timer_for(group, timer)
    timer.completed(timer.launched(_nbytes(tensor)))
    return dist.isend(tensor, dst)


def irecv(tensor: torch.Tensor, src: int, group: AxisGroup | None = None, *,
          timer: CommTimer | None = None) -> "_Receiving":
    """Point-to-point, asynchronous: start receiving into ``tensor`` from rank ``src``; ``wait()`` on what it
    returns before reading ``tensor``. Timed on ``timer`` from here to the end of that wait (the time a pipeline
    stage waits for its neighbour), counting no bytes (the sender counts them). Unlike :func:`recv` it is not held
    by a partition."""
    timer = timer_for(group, timer)
    start = timer.launched(0)
    return _Receiving(dist.irecv(tensor, src), timer, start)


class _Receiving:
    def __init__(self, work, timer: CommTimer, start: float):
        self.work, self.timer, self.start = work, timer, start

    def wait(self) -> None:
        self.work.wait()
        self.timer.completed(self.start)


def timed_all_reduce_mean(tensor: torch.Tensor, group: AxisGroup | None = None, *,
                          timer: CommTimer | None = None) -> torch.futures.Future:
    """Asynchronously all-reduce ``tensor`` in place and divide by the world size.

    Returns a future whose value is the averaged tensor.
    """
    timer = timer_for(group, timer)
    world = dist.get_world_size(process_group(group))
    timer.grad_ready(tensor)
    work = all_reduce(tensor, group, async_op=True, timer=timer)
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


def timed_allreduce_hook(state: tuple[CommTimer, object],
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: torch's plain averaging all-reduce, timed and counted.

    ``state`` is (timer, group): the timer counting it and the data-parallel group (None: the world).
    """
    timer, group = state
    return timed_all_reduce_mean(bucket.buffer(), group, timer=timer)


@contextmanager
def instrument_torch_collectives(timer: CommTimer, all_reduce_groups=()):
    """Count and time the all-gathers and reduce-scatters that torch's FSDP2 issues, and its all-reduces over
    ``all_reduce_groups`` (HSDP's replicate group; any other all-reduce passes through uncounted)."""

    def counted_all_gather(output, input, group=None, async_op=False):
        return all_gather(output, input, group, async_op, timer=timer)

    def counted_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return reduce_scatter(output, input, group, op, async_op, timer=timer)

    def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is not None and any(group is g for g in all_reduce_groups):
            return all_reduce(tensor, group, op, async_op, timer=timer)
        return outer_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_gather_single, dist.reduce_scatter_single = counted_all_gather, counted_reduce_scatter
    outer_all_reduce = dist.all_reduce  # put back as found (a dry run's recorder may hold it)
    if all_reduce_groups:
        dist.all_reduce = counted_all_reduce
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = _all_gather_single, _reduce_scatter_single
        dist.all_reduce = outer_all_reduce
