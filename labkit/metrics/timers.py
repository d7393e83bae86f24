"""Measuring where a step's time goes.

``StepClock`` times named phases of a step on the host (synchronising CUDA first, so GPU work is
counted where it ran, not where it was queued). ``CommTimer`` records when each collective was
launched and when it completed, from inside labkit's communication layer, so communication time
is *measured*:

* ``comm_s`` — wall time during which at least one collective was in flight (overlapping
  buckets are not double counted);
* ``comm_exposed_s`` — the part of it after backward's compute was done: the time the step sat
  waiting on the network because there was no compute left to hide it behind. Compute is done
  when the last gradient became ready (strategies that communicate from backward hooks report
  that moment with ``grad_ready()``) or, for those that communicate after backward, when
  backward returned (``backward_done()``).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class StepClock:
    """Totals per phase name, and every phase's (name, start, end) for a timeline of the step."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] = []

    def reset(self) -> None:
        self.totals.clear()
        self.spans = []

    @contextmanager
    def phase(self, name: str):
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            end = time.perf_counter()
            self.totals[name] += end - start
            self.spans.append((name, start, end))


class PartTimes:
    """Host seconds spent in each named part of the loop's bookkeeping, summed over the run.

    Only totals are kept (constant memory, however long the run): ``per_step()`` divides them by the
    steps counted, so a slower part shows by name in the summary and in ``benchmarks/overhead.py``.
    """

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def count_step(self) -> None:
        self.steps += 1

    def per_step(self) -> dict[str, float]:
        """Seconds per step in each part (0 steps counted: the totals as they are)."""
        return {name: total / max(1, self.steps) for name, total in self.totals.items()}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


class CommTimer:
    """Collects (launch, completion, bytes) of each collective; thread-safe (callbacks run on comm threads)."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._pending: list[float] = []
        self._last_grad_ready = None
        self._backward_done = None
        self.bytes = 0
        self.calls = 0

    def launched(self, wire_bytes: int) -> float:
        start = self._clock()
        with self._lock:
            self._pending.append(start)
            self.bytes += wire_bytes
            self.calls += 1
        return start

    def completed(self, start: float) -> None:
        end = self._clock()
        with self._lock:
            self._pending.remove(start)
            self._intervals.append((start, end))

    def grad_ready(self) -> None:
        self._last_grad_ready = self._clock()

    def backward_done(self) -> None:
        self._backward_done = self._clock()

    def collect(self) -> dict:
        """This step's totals, then start afresh for the next step."""
        with self._lock:
            intervals, nbytes, calls = self._intervals, self.bytes, self.calls
            compute_end = self._last_grad_ready or self._backward_done
            pending = self._pending
            self._reset()
            self._pending = pending  # still in flight: completes into the next step
        if compute_end is None:
            exposed = union_length(intervals)
        else:
            exposed = union_length([(max(s, compute_end), e) for s, e in intervals if e > compute_end])
        return {"comm_s": union_length(intervals), "comm_exposed_s": exposed, "comm_bytes": nbytes,
                "comm_calls": calls, "comm_intervals": sorted(intervals)}
