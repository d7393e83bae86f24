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


def consistency_problems(c, world: int) -> list[str]:
    """Bad consistency-lab settings (``comm.consistency`` and the network faults injected into its runs),
    said before any worker starts.

    Here rather than in labkit/consistency/, which imports labkit.distributed and so labkit.config:
    labkit.config.validate calls this, and the consistency package would close an import cycle."""
    problems = []
    if c.consistency in ("ssp", "async") and world < 2:
        problems.append(f"comm.consistency={c.consistency} runs a parameter server on rank 0 and workers on the "
                        f"other ranks: it needs at least 2 processes, got {world}")
    if c.staleness < 0:
        problems.append(f"comm.staleness: the bound s must be >= 0 clocks (0 is synchronous), got {c.staleness}")
    if c.duration_s is not None and c.duration_s <= 0:
        problems.append(f"comm.duration_s: must be > 0 seconds (or null), got {c.duration_s}")
    if c.measure_every < 1:
        problems.append(f"comm.measure_every: must be >= 1 step, got {c.measure_every}")
    for key, rank in [("partition_rank", c.partition_rank), ("slow_rank", c.slow_rank)]:
        if rank is not None and not 0 <= rank < world:
            problems.append(f"comm.{key}={rank} is outside the world: ranks are 0..{world - 1}")
    if c.partition_s < 0 or c.partition_start_s < 0:
        problems.append(f"comm.partition_start_s and comm.partition_s: must be >= 0 seconds, "
                        f"got {c.partition_start_s} and {c.partition_s}")
    if c.slow_factor < 1:
        problems.append(f"comm.slow_factor: a straggler is >= 1× slower, got {c.slow_factor}")
    if c.consistency is None and (c.partition_s > 0 or c.slow_rank is not None):
        problems.append("comm.partition_* and comm.slow_*: network faults are injected in consistency runs; "
                        "set comm.consistency (sync, local_sgd, ssp or async)")
    if c.partition_s > 0:
        end = c.partition_start_s + c.partition_s
        if c.partition_rank is None:
            problems.append("comm.partition_s > 0 but comm.partition_rank is not set: say which rank to isolate")
        if c.duration_s is None:
            problems.append("comm.partition_s > 0: set comm.duration_s so the partition can be placed inside the run")
        elif end >= c.duration_s:
            problems.append(f"comm.partition ({c.partition_start_s:g} s + {c.partition_s:g} s = {end:g} s) is longer "
                            f"than the run (comm.duration_s={c.duration_s:g} s): it would never heal")
    return problems
