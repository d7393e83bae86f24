"""A dry run's recording: every collective one training step launches, on torch's fake process group.

The fake backend (``torch.testing._internal.distributed.fake_pg``) returns from every collective at once and
moves no data, so what a dry run can observe is the *calls*: their kind, the process group's size and axis,
and their bytes. :func:`recording` wraps, while the run lasts, the real torch functions labkit's
communication layer captured at import (``collectives._all_reduce`` …) and the ``torch.distributed``
functions looked up when called (the pipeline's sends, ``labkit.comm.control``'s bookkeeping: the gradient
norm's one number …); both are put back afterwards. Each call becomes a :class:`Call`, whose wire bytes come
from the one table of ring factors, :data:`labkit.comm.collectives.WIRE_FACTOR`.

Bytes follow labkit's convention: an all-gather's output, a reduce-scatter's or an all-to-all's input, otherwise
the tensor.

Each call is named by the grid axis whose ranks its group holds (:func:`axis_namer`); a call launched by context
parallelism's attention (a function of ``labkit.parallel.cp`` on the stack: the ring's sends and receives, the
all-gather variant's gather and reduce-scatter, Ulysses' all-to-alls) is "cp" whatever its group — with dp = 1 the cp
group *is* the gradient group (dp × cp), and only who launched the call tells the two apart.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import torch.distributed as dist

from labkit.comm import collectives as layer
from labkit.comm.collectives import wire_bytes, wire_exact
from labkit.parallel.mesh import EXPERT_GRADIENT_AXIS


@dataclass
class Call:
    """One collective as launched: ``source`` is "labkit" (a function labkit.comm.collectives captured) or "torch"
    (a ``torch.distributed`` function looked up when called)."""

    kind: str
    group_size: int
    axis: str
    nbytes: int
    source: str

    @property
    def wire_exact(self) -> Fraction:
        """The bytes this rank sends, exactly: what the analytic counts are compared with."""
        return wire_exact(self.kind, self.nbytes, self.group_size)

    @property
    def wire(self) -> int:
        """What labkit's CommTimer counts for it: the same, rounded down to a whole byte."""
        return wire_bytes(self.kind, self.nbytes, self.group_size)


@dataclass
class Recorder:
    """Collects :class:`Call` records while ``recording`` is on; ``axis_of`` names a group's axis."""

    axis_of: object = None
    calls: list = field(default_factory=list)
    recording: bool = False

    def add(self, kind: str, tensor_bytes: int, group, source: str) -> None:
        if not self.recording:
            return
        point_to_point = kind in ("send", "recv")
        size = 2 if point_to_point else dist.get_world_size(group)  # a send or a receive: the pair
        if launched_by_context_parallel():
            axis = "cp"
        elif launched_by(EXPERT_PARALLEL):  # the dispatch's all-to-alls, or the experts' gradient sum
            axis = "ep" if kind.startswith("all_to_all") else EXPERT_GRADIENT_AXIS
        else:  # a pipeline's sends name no group (global ranks)
            axis = self.axis_of("p2p" if point_to_point and group is None else group)
        self.calls.append(Call(kind, size, axis, tensor_bytes, source))


CONTEXT_PARALLEL = "labkit.parallel.cp"  # the package whose functions launch context parallelism's collectives
EXPERT_PARALLEL = "labkit.parallel.ep"  # and expert parallelism's (on a group that may be dp's: ep = dp)


def launched_by_context_parallel() -> bool:
    """Whether a function of :data:`CONTEXT_PARALLEL` is on the calling stack (its attention's forward, or its
    autograd backward, which the autograd engine calls from Python on this thread)."""
    return launched_by(CONTEXT_PARALLEL)


def launched_by(package: str) -> bool:
    """Whether a function of ``package`` is on the calling stack."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == package or name.startswith(package + "."):
            return True
        frame = frame.f_back
    return False


class _WithResult:
    """An async collective's work whose future holds its output tensors, as gloo's and NCCL's do: the fake
    group's future completes with None, and torch DDP's communication hook (labkit's
    ``timed_all_reduce_mean``) reads the reduced bucket from it."""

    def __init__(self, work, result):
        self._work, self._result = work, result

    def get_future(self):
        return self._work.get_future().then(lambda _: self._result)

    def wait(self, *args):
        return self._work.wait(*args)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# What each wrapped function's arguments say: (its bytes by labkit's convention, its process group).

def _first(tensor, *a, group=None, **k):
    return _nbytes(tensor), group


def _gather_out(output, input, group=None, **k):
    return _nbytes(output), group


def _scatter_in(output, input, op=None, group=None, **k):
    return _nbytes(input), group


def _all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
    """An even all-to-all's size (its input), or an uneven one's bytes to the others (kind ``all_to_all_v``)."""
    if input_split_sizes is None:
        return _nbytes(input), group
    return layer.uneven_sent_bytes(input, input_split_sizes, group), group, "all_to_all_v"


def _p2p(tensor, *a, group=None, **k):
    return _nbytes(tensor), group


def _gather_list(outputs, input, group=None, **k):
    return _nbytes(input) * len(outputs), group


# name → (kind, how to read its arguments): the functions labkit's layer captured, and torch's own
LAYER_FUNCTIONS = {"_all_reduce": ("all_reduce", _first), "_all_gather_single": ("all_gather", _gather_out),
                   "_reduce_scatter_single": ("reduce_scatter", _scatter_in), "_broadcast": ("broadcast", _first),
                   "_all_to_all_single": ("all_to_all", _all_to_all)}
TORCH_FUNCTIONS = {"all_reduce": ("all_reduce", _first), "broadcast": ("broadcast", _first),
                   "all_gather_single": ("all_gather", _gather_out),
                   "all_gather_into_tensor": ("all_gather", _gather_out),
                   "reduce_scatter_single": ("reduce_scatter", _scatter_in),
                   "reduce_scatter_tensor": ("reduce_scatter", _scatter_in), "all_gather": ("all_gather", _gather_list),
                   "send": ("send", _p2p), "isend": ("send", _p2p), "recv": ("recv", _p2p), "irecv": ("recv", _p2p)}


def _recorded(recorder: Recorder, real, kind: str, source: str, pick):
    """``real``, recording each call in ``recorder`` first."""
    def recorded(*args, **kwargs):
        nbytes, group, *named = pick(*args, **kwargs)  # a picker may name the kind (an uneven all-to-all)
        recorder.add(named[0] if named else kind, nbytes, group, source)
        if kind == "recv":  # the fake group writes nothing: a received buffer would be uninitialised memory
            args[0].zero_()  # (NaNs in it would make the step skip its update); zeros keep the step finite
        work = real(*args, **kwargs)
        if source == "labkit" and kwargs.get("async_op") and work is not None:
            return _WithResult(work, [args[0]])
        return work
    return recorded


@contextmanager
def recording(recorder: Recorder):
    """Wrap the real functions labkit's layer captured, and the torch.distributed ones looked up when called."""
    saved_layer = {name: getattr(layer, name) for name in LAYER_FUNCTIONS}
    saved_torch = {name: getattr(dist, name) for name in TORCH_FUNCTIONS}
    try:
        for name, (kind, pick) in LAYER_FUNCTIONS.items():
            setattr(layer, name, _recorded(recorder, saved_layer[name], kind, "labkit", pick))
        for name, (kind, pick) in TORCH_FUNCTIONS.items():
            setattr(dist, name, _recorded(recorder, saved_torch[name], kind, "torch", pick))
        yield recorder
    finally:
        for name, real in saved_layer.items():
            setattr(layer, name, real)
        for name, real in saved_torch.items():
            setattr(dist, name, real)


def axis_namer(grid):
    """A function naming a process group by the grid axis whose ranks it holds ("dp", "pp", "cp", "tp", "world"),
    "dp_cp" for the gradient group of dp × cp when cp > 1 (:data:`labkit.parallel.mesh.GRADIENT_AXIS`; named before
    cp, which it is when dp = 1: context parallelism's own calls are told apart by who launched them, see
    :meth:`Recorder.add`), "tied" for a pipeline's first and last stage (the tied embedding's group), else "group of
    N"."""
    from labkit.parallel.mesh import DEGREES, GRADIENT_AXIS, SHARD_AXIS

    by_ranks = {}
    gradient = (GRADIENT_AXIS,) if grid.size("cp") > 1 else ()
    hsdp = (SHARD_AXIS, "dp_replicate") if grid.size("dp_replicate") > 1 else ()  # FSDP2's groups with HSDP
    for axis in (*gradient, *hsdp, *reversed(DEGREES), "world"):  # a one-axis grid: the dp group is the world, named dp
        by_ranks.setdefault(tuple(grid.ranks(axis)), axis)
    pp = grid.ranks("pp")
    by_ranks.setdefault((pp[0], pp[-1]), "tied")
    if grid.size("dp") == grid.dims.world_size:
        by_ranks[tuple(range(grid.dims.world_size))] = "dp"

    def axis_of(group) -> str:
        if group == "p2p":
            return "pp"
        ranks = tuple(range(grid.dims.world_size)) if group is None else tuple(dist.get_process_group_ranks(group))
        return by_ranks.get(ranks, f"group of {len(ranks)}")
    return axis_of
