"""Which timer counts a collective: the step says it once, per axis of the mesh; a layer names only its group.

A layer written from the paper reads ``copy_to_tp(x, group)``: where its bytes are counted is not its business.
So the group a layer holds is typed — an :class:`AxisGroup`, torch's process group together with the name of the
mesh axis it spans ("tp", "cp", "pp", "dp_cp", …) — and the trainer's step says, for its length, which
``CommTimer`` counts each axis (:func:`counting`; the step meter's ``timers_by_axis``: the data-parallel strategy's
gradient axis on the strategy's timer, tp and cp on the model's, the pipeline's sends on its own). Every collective
of :mod:`labkit.comm.collectives` launched on an AxisGroup is counted, timed and emulated on its axis's timer; one
on an axis nobody is counting (an evaluation between steps, a layer tried alone in a notebook) moves its bytes
uncounted. A strategy still holds its timer, but only to take the time it waits (exposed communication); torch's
own engines, which call collectives from C++ (DDP's hook) or deep inside FSDP2, are handed it.

Why the axis and not the process group: two axes can be the same ranks, and torch then hands back the same group
(with cp = 1 the gradient axis dp_cp *is* dp; with dp = 1 it is cp), yet their traffic is counted apart — the
strategy's gradients on one timer, the ring's keys and values on another.

The table is one for the process, not per thread: a collective launched from a backward hook on an autograd
thread (CUDA) is counted like one launched by the loop.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


from labkit.metrics.timers import CommTimer

_TIMERS: dict[str, CommTimer] = {}  # axis → the timer counting it now (set by counting())


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """The ranks of one axis of the mesh: torch's process group (``group``; None, the default group: every rank)
    and the axis's name (``axis``), which says which timer counts what is sent on it."""

    axis: str
    group: object = None


def process_group(group):
    """torch's process group behind ``group`` (an AxisGroup, a process group, or None: the default one)."""
    return group.group if isinstance(group, AxisGroup) else group


@contextmanager
def counting(timers: dict[str, CommTimer]):
    """For the length of the block, count the collectives on each axis of ``timers`` on its timer (axes not named
    keep what an enclosing block set)."""
    saved = dict(_TIMERS)
    _TIMERS.update(timers)
    try:
        yield
    finally:
        _TIMERS.clear()
        _TIMERS.update(saved)


def timer_for(group, timer: CommTimer | None = None) -> CommTimer:
    """The timer a collective on ``group`` is counted on: ``timer`` when the caller gives one (code that keeps its
    own, outside a step: the parameter server, a compressor's test), else the one :func:`counting` set for the
    group's axis, else a timer nobody reads."""
    if timer is not None:
        return timer
    if isinstance(group, AxisGroup) and group.axis in _TIMERS:
        return _TIMERS[group.axis]
    return CommTimer()
