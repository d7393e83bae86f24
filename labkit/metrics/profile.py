"""Reading a ``torch.profiler`` capture: a trace to open, a table to read, one split to remember.

An anomaly alert says *that* a step got slower; a profile says *where*. Three views of one capture:

* the **chrome trace** (``chrome://tracing`` or https://ui.perfetto.dev): every op on a timeline,
  per thread and per CUDA stream — where overlap, gaps and waits become visible;
* the **top-ops table**: operators ranked by the time spent in them;
* the **compute vs communication split**: how much op time went to collectives.

The split sums *self* time — the time inside an op minus the time inside the ops it called — so
nothing is counted twice (``aten::linear`` calls ``aten::addmm``; their total times overlap, their
self times do not). It uses device time when the capture has any (on a GPU the host only
launches kernels, so host time says little), else host CPU time. A collective is recognised by
its name: the c10d ops (``c10d::allreduce_``), the backends' own spans (``gloo:all_reduce``,
``nccl:all_reduce``) and NCCL's kernels (``ncclDevKernel_AllReduce...``).

Caveat for the CPU: gloo runs its collectives on its own threads, and a collective's time
includes *waiting* for the slowest rank. A large communication share on one rank can mean a slow
network or a slow peer — compare ranks before blaming the network.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMM_MARKERS = ("all_reduce", "allreduce", "allgather", "all_gather", "broadcast", "reduce_scatter",
                "reducescatter", "gloo", "nccl")
NOT_OPS = ("ProfilerStep#", "[memory]")
"""Entries that are not operators: a step's own span (its self time is host time between ops) and allocations."""


@dataclass
class ProfileSummary:
    trace_path: Path
    table: str  # the top operators, as torch formats them
    time_kind: str  # "device" or "cpu": which self times were summed
    compute_us: float
    comm_us: float

    @property
    def comm_frac(self) -> float:
        total = self.compute_us + self.comm_us
        return self.comm_us / total if total else 0.0

    def describe(self) -> str:
        return (f"{self.time_kind} op time: compute {self.compute_us / 1e3:.1f} ms, communication "
                f"{self.comm_us / 1e3:.1f} ms ({self.comm_frac:.0%}); trace: {self.trace_path}")


def is_communication(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


def self_device_us(op: Any) -> float:
    """Self device time of an averaged op (the attribute was renamed from ``cuda`` to ``device``)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(op, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def compute_comm_split(averages: Any) -> tuple[str, float, float]:
    """(time kind, compute µs, communication µs) summed over a capture's averaged operators' self times."""
    ops = [op for op in averages if not op.key.startswith(NOT_OPS)]
    use_device = any(self_device_us(op) > 0 for op in ops)
    compute = comm = 0.0
    for op in ops:
        spent = self_device_us(op) if use_device else float(op.self_cpu_time_total)
        if is_communication(op.key):
            comm += spent
        else:
            compute += spent
    return ("device" if use_device else "cpu"), compute, comm


def top_ops_table(averages: Any, row_limit: int = 15) -> str:
    """The operators that took longest (self time), as torch's own formatted table."""
    use_device = any(self_device_us(op) > 0 for op in averages)
    sort_by = "self_device_time_total" if use_device else "self_cpu_time_total"
    try:
        return averages.table(sort_by=sort_by, row_limit=row_limit)
    except (AttributeError, KeyError):  # torch before the cuda → device rename
        return averages.table(sort_by="self_cuda_time_total", row_limit=row_limit)


def summarize_profile(prof: Any, trace_path: str | Path, row_limit: int = 15) -> ProfileSummary:
    """Write ``prof``'s chrome trace to ``trace_path``; return the top-ops table and the compute/comm split."""
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    averages = prof.key_averages()  # once: averaging a capture's events is the slow part of reading it
    kind, compute, comm = compute_comm_split(averages)
    return ProfileSummary(trace_path, top_ops_table(averages, row_limit), kind, compute, comm)
