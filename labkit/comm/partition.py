"""Network faults you can schedule: a partition that isolates one rank, and a straggler.

A *partition* cuts rank r off for a while. Its messages are not lost, they are *held*: every
send, receive or collective that rank r starts through labkit's communication layer waits until
the partition heals. What the other ranks do meanwhile depends on the consistency model —
synchronous ones wait for r (and lose availability), asynchronous ones carry on without it
(and lose consistency). That is the CAP trade-off (Brewer 2000; Gilbert & Lynch 2002), seen on
a training run.

A *straggler* is not cut off, just slow: it computes ``slow_factor`` times longer than it would.

Times are seconds after the run's start ``t0`` (``time.time()``, agreed by broadcast at start), so
every rank sees the same partition window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NetworkFaults:
    partition_rank: Optional[int] = None
    partition_start_s: float = 0.0
    partition_s: float = 0.0
    slow_rank: Optional[int] = None
    slow_factor: float = 1.0
    t0: float = 0.0

    @classmethod
    def from_config(cls, comm_cfg, t0: float) -> "NetworkFaults":
        return cls(comm_cfg.partition_rank, comm_cfg.partition_start_s, comm_cfg.partition_s,
                   comm_cfg.slow_rank, comm_cfg.slow_factor, t0)

    @property
    def window(self) -> Optional[tuple[float, float]]:
        """(start, heal) in seconds after t0, or None when no partition is scheduled."""
        if self.partition_rank is None or self.partition_s <= 0:
            return None
        return self.partition_start_s, self.partition_start_s + self.partition_s

    def isolated(self, rank: int, now: Optional[float] = None) -> bool:
        """Is ``rank`` cut off at ``now`` (time.time(); default: the present)?"""
        window = self.window
        if window is None or rank != self.partition_rank:
            return False
        elapsed = (time.time() if now is None else now) - self.t0
        return window[0] <= elapsed < window[1]

    def hold(self, rank: int) -> float:
        """If ``rank`` is cut off now, wait until the partition heals; returns the seconds held."""
        if not self.isolated(rank):
            return 0.0
        started = time.time()
        time.sleep(max(0.0, self.t0 + self.window[1] - started))
        return time.time() - started

    def slow_down(self, rank: int, busy_s: float) -> float:
        """A straggler spends (slow_factor − 1) × its compute time more; returns the seconds added."""
        if rank != self.slow_rank or self.slow_factor <= 1:
            return 0.0
        extra = (self.slow_factor - 1) * busy_s
        time.sleep(extra)
        return extra


NO_FAULTS = NetworkFaults()
_current = NO_FAULTS


def set_faults(faults: NetworkFaults) -> None:
    global _current
    _current = faults


def current() -> NetworkFaults:
    return _current
