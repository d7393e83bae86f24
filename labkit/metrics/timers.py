"""Measuring where a step's time goes.

``StepClock`` times named phases of a step on the host (synchronising CUDA first, so GPU work is
counted where it ran, not where it was queued). ``CommTimer`` records when each gradient
all-reduce was launched and when it completed, from inside the communication hook, so
communication time is *measured*: ``comm_s`` is the wall time during which at least one
all-reduce was in flight (overlapping buckets are not double counted), and ``comm_exposed_s`` is
the part of it after the last bucket was launched — the time the step sat waiting on the network
because backward had no compute left to overlap with.
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
    def __init__(self, device: str = "cpu"):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.totals.clear()

    @contextmanager
    def phase(self, name: str):
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.totals[name] += time.perf_counter() - start


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

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._pending: list[float] = []
        self.bytes = 0
        self.calls = 0

    def launched(self, nbytes: int) -> float:
        start = time.perf_counter()
        with self._lock:
            self._pending.append(start)
            self.bytes += nbytes
            self.calls += 1
        return start

    def completed(self, start: float) -> None:
        end = time.perf_counter()
        with self._lock:
            self._pending.remove(start)
            self._intervals.append((start, end))

    def collect(self) -> dict:
        """This step's totals, then start afresh for the next step."""
        with self._lock:
            intervals, self._intervals = self._intervals, []
            nbytes, calls = self.bytes, self.calls
            self.bytes = self.calls = 0
        last_launch = max((s for s, _ in intervals), default=0.0)
        last_end = max((e for _, e in intervals), default=0.0)
        return {
            "comm_s": union_length(intervals),
            "comm_exposed_s": max(0.0, last_end - last_launch) if intervals else 0.0,
            "comm_bytes": nbytes,
            "comm_calls": calls,
        }
