"""What :mod:`labkit.sim.calibrate` fits to and predicts from, taken from this machine and from labkit's code.

* :func:`time_collectives` — gloo's collectives **measured** in a live process group (every rank calls it),
  timed the way a training step issues them.
* :func:`dry_run_calls` — the collectives one step of a layout issues, **counted** (not timed) by a dry run of
  labkit's real code on torch's fake process group (:func:`labkit.sim.dryrun.dry_run`).
"""
from __future__ import annotations

import statistics
import time

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
SLICE_MATMULS = 20  # compute before each timed collective: 20 (128×256)·(256×256) matmuls, a few ms, about
#                     what a TP layer computes between two of its collectives here
BACK_TO_BACK_REPEATS = 5


def time_collectives(sizes: list[int], repeats: int = 12, ops=COLLECTIVE_OPS) -> list[dict]:
    """Time each gloo collective at each size (bytes) on the default group, as a training step issues it.

    ``seconds``: what the collective adds to a loop of compute slices (:data:`SLICE_MATMULS` matmuls) when it
    follows each slice — the loop with it minus the loop without, per call; the two loops alternated three
    times, medians. On this kind of machine that is several times ``back_to_back`` (one call right after a
    barrier, for comparison): a rank that arrives first idles its core until the other's data arrives, and
    must be woken. ``send``: rank 2k to rank 2k + 1. Each row holds the slowest rank's times.
    """
    import torch
    import torch.distributed as dist

    from labkit.comm import control

    world = dist.get_world_size()
    a, b = torch.randn(128, 256), torch.randn(256, 256)

    def loop(call, n: int) -> float:
        control.barrier()
        start = time.perf_counter()
        for _ in range(n):
            for _ in range(SLICE_MATMULS):
                a @ b
            call()
        return (time.perf_counter() - start) / n

    def back_to_back(call) -> float:
        samples = []
        for _ in range(BACK_TO_BACK_REPEATS):
            control.barrier()
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    rows, times = [], []
    for op in ops:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)
            full, part = torch.ones(n), torch.ones(n // world)
            call = control.bare_collective(op, full, part)  # bare: the link itself is what is measured
            call()  # the first call sets up buffers
            reps = repeats if nbytes <= 1 << 20 else max(2, repeats // 3)
            loops = [(loop(lambda: None, reps), loop(call, reps)) for _ in range(3)]
            added = statistics.median(t for _, t in loops) - statistics.median(t for t, _ in loops)
            rows.append({"op": op, "world": world, "bytes": 4 * n})
            times += [added, back_to_back(call)]
    slowest = control.max_over_ranks(torch.tensor(times, dtype=torch.float64))
    return [{**row, "seconds": added, "back_to_back": back}
            for row, (added, back) in zip(rows, slowest.view(-1, 2).tolist())]


def dry_run_calls(cfg, world: int) -> tuple[tuple[str, int, int], ...]:
    """(kind, group size, bytes of the whole tensor) of every collective one step of rank 0 issues, recorded
    by a dry run (no data moved, nothing timed). Call it where no process group is initialised."""
    from labkit.sim.dryrun import dry_run

    return tuple((c.kind, c.group_size, c.nbytes) for c in dry_run(cfg, world)["calls"])
