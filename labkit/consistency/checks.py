"""The CAP lab's checks, collected by :func:`labkit.validation.validate`. Imports nothing from labkit."""
from __future__ import annotations


def consistency_problems(c, world: int) -> list[str]:
    """Bad consistency-lab settings (``comm.consistency`` and its network faults), said before any worker starts."""
    problems = []
    if c.consistency in ("ssp", "async") and world < 2:
        problems.append(f"comm.consistency={c.consistency} runs a parameter server on rank 0 and workers on the "
                        f"other ranks: it needs at least 2 processes, got {world}")
    if c.consistency is not None and c.backend == "nccl":
        problems.append("comm.backend=nccl: the CAP lab (comm.consistency) keeps its tensors on the CPU and "
                        "its parameter server receives from any worker, which NCCL cannot do; it runs on gloo "
                        "— use comm.backend=auto or gloo")
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
