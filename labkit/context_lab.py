"""Notebook 12's live run: context-parallel attention on cp real gloo processes, started through torchrun.

:func:`run_lab` starts ``cp`` workers (``python -m torch.distributed.run … -m labkit.context_lab``) and
returns what they measured, merged over the ranks; each worker (:func:`worker`) on one sequence of ``seq``
tokens:

* **checks** every variant (ring, all-gather KV, Ulysses) against one rank's attention, forward and every
  gradient (:func:`labkit.parallel.cp.check.gradient_check`), and keeps the bytes it sent, counted at the
  collectives, beside :func:`labkit.parallel.cp.volume.cp_wire_bytes`;
* **records the ring**, step by step, under both layouts: which key/value block each rank held, seconds
  computing on it and seconds waiting for the next (what the notebook draws), and its own CPU seconds;
* **times** each variant (forward and backward, head-tail chunks) in ``rounds`` rounds whose order rotates;
* **switches on each bug of the zoo** (:mod:`labkit.parallel.cp.bugs`) and runs the same check.

The worker leaves when its agent does (``labkit.launcher.exit_when_orphaned``), so a kernel interrupt leaves no
process behind.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADS, HEAD_DIM = 4, 32  # the timed sequence's attention: 4 heads of 32, fp32
CHECK_SHAPE = (1, 4, 32, 8)  # the checks' (batch, heads, seq, head dim): small, fp32


def run_lab(cp: int = 2, seq: int = 512, rounds: int = 3, timeout_s: float = 300) -> dict:
    """Start ``cp`` workers through torchrun on this machine and return their merged measurements."""
    from labkit.launcher import free_port
    from labkit.parallel.cp.sharding import n_chunks

    if cp < 2:
        raise ValueError(f"context parallelism needs cp >= 2 ranks, got {cp}")
    if seq % n_chunks(cp, "head_tail"):  # 2·cp chunks (the contiguous layout's cp then divide it too)
        raise ValueError(f"seq={seq} does not cut into {2 * cp} equal chunks: use a multiple of {2 * cp}")
    with tempfile.TemporaryDirectory(prefix="labkit-cp-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "labkit.context_lab", out, json.dumps({"seq": seq, "rounds": rounds})]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"the context-parallel lab's workers failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    return merge(ranks)


def merge(ranks: list[dict]) -> dict:
    """One record from every rank's: checks and bugs per rank, the ring's timeline per layout and rank, and each
    variant's time per round (the slowest rank's: the call ends when its last rank does)."""
    first = ranks[0]
    rounds = {variant: [max(r["times"][variant][i] for r in ranks) for i in range(len(first["times"][variant]))]
              for variant in first["times"]}
    return {"cp": len(ranks), "seq": first["seq"], "heads": HEADS, "head_dim": HEAD_DIM,
            "checks": {name: [r["checks"][name] for r in ranks] for name in first["checks"]},
            "bugs": {name: [r["bugs"][name] for r in ranks] for name in first["bugs"]},
            "timelines": {layout: [r["timelines"][layout] for r in ranks] for layout in first["timelines"]},
            "cpu_s": {layout: [r["cpu_s"][layout] for r in ranks] for layout in first["cpu_s"]},
            "rounds_s": rounds, "median_s": {v: statistics.median(t) for v, t in rounds.items()}}


# ---------------------------------------------------------------- one worker, under torchrun

def worker(out: str, seq: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from labkit.comm.control import barrier
    from labkit.launcher import exit_when_orphaned
    from labkit.parallel.cp import VARIANTS, attention
    from labkit.parallel.cp.bugs import BUGS, bug
    from labkit.parallel.cp.check import gradient_check
    from labkit.parallel.cp.volume import cp_wire_bytes

    exit_when_orphaned()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    record = {"seq": seq, "checks": {}, "bugs": {}, "timelines": {}, "cpu_s": {}, "times": {v: [] for v in VARIANTS}}
    for variant in VARIANTS:
        checked = gradient_check(attention(variant), "head_tail", True, torch.float32, CHECK_SHAPE)
        record["checks"][variant] = {**checked, "expected": cp_wire_bytes(variant, cp, checked["block_bytes"])}
    for name in BUGS:
        with bug(name):
            record["bugs"][name] = gradient_check(attention("ring"), "head_tail", True, torch.float32, CHECK_SHAPE)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, HEADS, seq // cp, HEAD_DIM, generator=g, requires_grad=True) for _ in range(3))
    attention("ring")(q, k, v).sum().backward()  # warm-up: the first call's allocations are no layout's
    for layout in ("contiguous", "head_tail"):
        timeline = []
        barrier()
        cpu = time.thread_time()
        attention("ring")(q, k, v, layout=layout, timeline=timeline).sum().backward()
        record["cpu_s"][layout] = time.thread_time() - cpu
        record["timelines"][layout] = timeline
    for r in range(rounds):
        shift = r % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            barrier()
            began = time.perf_counter()
            attention(variant)(q, k, v, layout="head_tail").sum().backward()
            record["times"][variant].append(time.perf_counter() - began)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], **json.loads(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # as labkit's workers do: no C++ destructors racing gloo's threads
