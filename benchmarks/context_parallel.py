"""Context parallelism's attention alone: ring, all-gather KV and Ulysses at cp = 2 and 4, their bytes, their time,
and the causal work each rank does under the contiguous and the head-tail split.

One attention call (forward and backward) on a sequence of ``--seq`` tokens, 8 heads of 64, fp32, on cp gloo
processes of one machine (``labkit.parallel.cp``). Every (variant, layout) runs in each round, in an order that
rotates round by round so that a slow minute of a shared machine falls on all alike; each round's time is the
slowest rank's wall clock, the median of ``--repeats`` calls. Recorded per (cp, variant, layout):

- **bytes** one rank sent in forward and backward, counted at the collectives (``CommTimer``), beside
  :func:`labkit.parallel.cp.volume.cp_wire_bytes` — target: equal to the byte;
- **time**: every round, the median and IQR (:mod:`labkit.rounds`), and each variant's ratio to the ring in
  the same round (a ratio's verdict only when its IQR excludes 1.0);
- **activations kept for backward** per rank, counted at autograd's saved-tensor hooks
  (:class:`labkit.metrics.memory.count_saved_bytes`), beside :func:`labkit.parallel.cp.volume.cp_saved_bytes` and
  beside one rank's attention over the whole sequence (the same formula at cp = 1): ring and Ulysses keep 1/cp of
  it, all-gather KV (2 + 2·cp)/(4·cp) — target: equal to the byte;
- **causal imbalance**: max/mean over ranks of each rank's CPU time in the call (``time.thread_time``: the
  OS's clock of the calling thread, which stops while it waits in a receive or is descheduled), beside the
  counted work's max/mean (:func:`labkit.parallel.cp.volume.cp_imbalance`): in the FLOPs the causal mask leaves,
  (2·cp − 1)/cp contiguous and 1 head-tail; in the blocks :mod:`labkit.parallel.cp.blocks` computes (a diagonal
  block whole, then masked), 2·cp/(cp + 1) contiguous and 1 head-tail; Ulysses 1 either way, each rank attending
  whole sequences of its heads. The chunk size differs too: a contiguous chunk is twice a head-tail one, and a
  bigger block of scores runs slower per score on a CPU's caches, so the two layouts' times differ by more than
  their imbalance.
  At cp = 4 four processes share 2 cores here: the CPU clock still counts each rank's own work.

    .venv/bin/python benchmarks/context_parallel.py [--rounds 6] [--seq 2048] [--repeats 3]
    .venv/bin/python benchmarks/context_parallel.py --quick     # a short sequence, one round: what CI runs

Each run appends one JSON line to ``benchmarks/results/context_parallel.jsonl`` (``$LABKIT_RESULTS_DIR``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEGREES = (2, 4)
HEADS, HEAD_DIM = 8, 64
LAYOUT_NAMES = ("contiguous", "head_tail")


def cases() -> list[tuple[str, str]]:
    from labkit.parallel.cp import VARIANTS

    return [(variant, layout) for variant in VARIANTS for layout in LAYOUT_NAMES]


def round_order(items: list, r: int) -> list:
    """The cases rotated by r: each takes every place in the order once per len(items) rounds."""
    k = r % len(items)
    return items[k:] + items[:k]


# ---------------------------------------------------------------- the worker: one cp group, every case, every round

def one_call(variant: str, layout: str, seq: int, seed: int) -> dict:
    """One forward and backward of ``variant`` on this rank's chunks: wall and CPU seconds, bytes sent."""
    import torch
    import torch.distributed as dist

    from labkit.comm.axes import AxisGroup, counting
    from labkit.metrics.memory import count_saved_bytes
    from labkit.metrics.timers import CommTimer
    from labkit.parallel.cp import attention, shard

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (shard(torch.randn(1, HEADS, seq, HEAD_DIM, generator=g), rank, cp, layout) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    timer = CommTimer()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    with counting({"cp": timer}):  # the bytes sent on the cp axis, forward and backward
        with count_saved_bytes() as saved:
            out = attention(variant)(q, k, v, group=AxisGroup("cp"), layout=layout, causal=True)
        forward_bytes = timer.bytes
        out.backward(d_out)
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu,
            "bytes": {"forward": forward_bytes, "backward": timer.bytes - forward_bytes},
            "block_bytes": q.numel() * q.element_size(), "saved_bytes": saved.total,
            "lse_bytes": 4 * q[..., 0].numel()}


def worker(out: Path, rounds: int, seq: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    one_call("ring", "head_tail", seq, 0)  # warm-up: first-call costs out of the rounds
    rows = []
    for r in range(rounds):
        for variant, layout in round_order(cases(), r):
            calls = [one_call(variant, layout, seq, r * repeats + i) for i in range(repeats)]
            rows.append({"round": r, "variant": variant, "layout": layout, "calls": calls})
        if rank == 0:
            print(f"  cp={dist.get_world_size()} round {r + 1}/{rounds} done", flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_workers(out: Path, cp: int, args) -> list[list[dict]]:
    from labkit.launcher import free_port

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", str(out), "--rounds", str(args.rounds),
           "--seq", str(args.seq), "--repeats", str(args.repeats)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(cp)]


# ---------------------------------------------------------------- reading the ranks back (pure)

def per_case(ranks: list[list[dict]]) -> dict[tuple[str, str], list[dict]]:
    """(variant, layout) → one entry per round: the slowest rank's median wall time, every rank's median CPU
    time, and the bytes rank 0 sent (identical calls: the first)."""
    found: dict[tuple[str, str], list[dict]] = {}
    for rows in zip(*ranks):  # the same (round, case) on every rank
        first = rows[0]
        wall = max(statistics.median(c["wall_s"] for c in row["calls"]) for row in rows)
        cpu = [statistics.median(c["cpu_s"] for c in row["calls"]) for row in rows]
        found.setdefault((first["variant"], first["layout"]), []).append(
            {"round": first["round"], "wall_s": wall, "rank_cpu_s": cpu,
             "bytes": [r["calls"][0]["bytes"] for r in rows], "block_bytes": first["calls"][0]["block_bytes"],
             "saved_bytes": [r["calls"][0]["saved_bytes"] for r in rows], "lse_bytes": first["calls"][0]["lse_bytes"]})
    return found


def max_over_mean(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def case_rows(cp: int, found: dict) -> list[dict]:
    """One results row per (variant, layout): bytes against the formula, time with its rounds, imbalance."""
    from labkit.parallel.cp.volume import cp_imbalance, cp_saved_bytes, cp_wire_bytes
    from labkit.rounds import describe, quartiles, ratio_summary

    rows = []
    for (variant, layout), rounds in found.items():
        block, lse = rounds[0]["block_bytes"], rounds[0]["lse_bytes"]
        expected = cp_wire_bytes(variant, cp, block)
        saved = [b for entry in rounds for b in entry["saved_bytes"]]
        saved_expected, one_rank = cp_saved_bytes(variant, cp, block, lse), cp_saved_bytes(variant, 1, cp * block,
                                                                                            cp * lse)
        counted = [b for entry in rounds for b in entry["bytes"]]
        ring = found[("ring", layout)]
        ratio = ratio_summary([mine["wall_s"] / theirs["wall_s"] for mine, theirs in zip(rounds, ring)])
        walls = [entry["wall_s"] for entry in rounds]
        q1, median, q3 = quartiles(walls)
        measured = [max_over_mean(entry["rank_cpu_s"]) for entry in rounds]
        rows.append({
            "cp": cp, "variant": variant, "layout": layout,
            "bytes_forward": counted[0]["forward"], "bytes_backward": counted[0]["backward"], "expected": expected,
            "bytes_held": all(b == expected for b in counted),
            "saved_bytes": saved[0], "saved_expected": saved_expected, "saved_held": set(saved) == {saved_expected},
            "saved_one_rank": one_rank, "saved_fraction": saved[0] / one_rank,
            "wall_s": median, "wall_q1": q1, "wall_q3": q3, "wall_rounds": walls,
            "vs_ring": None if variant == "ring" else {**ratio, "summary": describe(ratio, f"{variant}/ring")},
            "imbalance_cpu": statistics.median(measured), "imbalance_cpu_rounds": measured,
            "imbalance_counted": cp_imbalance(variant, cp, layout),
            "imbalance_blocks_computed": cp_imbalance(variant, cp, layout, diagonal=1.0),
            "rank_cpu_s": [e["rank_cpu_s"] for e in rounds]})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'cp':>2} {'variant':<9} {'layout':<10} {'fwd bytes':>11} {'bwd bytes':>11} {'= formula':>9} "
          f"{'time ms':>8} {'IQR':>13} {'imbalance: CPU clock':>20} {'masked FLOPs':>12} {'blocks':>6} "
          f"{'kept MB':>8} {'= formula':>9} {'× 1 rank':>8}")
    for r in rows:
        print(f"{r['cp']:>2} {r['variant']:<9} {r['layout']:<10} {r['bytes_forward']:>11,} {r['bytes_backward']:>11,} "
              f"{'yes' if r['bytes_held'] else 'NO':>9} {1e3 * r['wall_s']:8.1f} "
              f"{1e3 * r['wall_q1']:6.1f}–{1e3 * r['wall_q3']:<6.1f} {r['imbalance_cpu']:20.3f} "
              f"{r['imbalance_counted']:12.3f} {r['imbalance_blocks_computed']:6.3f} {r['saved_bytes'] / 1e6:8.3f} "
              f"{'yes' if r['saved_held'] else 'NO':>9} {r['saved_fraction']:8.3f}")
        if r["vs_ring"]:
            print(f"   {r['vs_ring']['summary']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a 64-token sequence, one round, one repeat")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seq, args.repeats = 1, 64, 1
    if args.worker:
        return worker(args.worker, args.rounds, args.seq, args.repeats)
    if args.rounds < 1 or args.repeats < 1 or args.seq % (2 * max(DEGREES)):
        parser.error(f"--rounds and --repeats must be >= 1 and --seq divisible by {2 * max(DEGREES)} "
                     "(head-tail cuts it into 2·cp chunks)")
    from labkit.results import write_results

    started, rows = time.perf_counter(), []
    print(f"{args.rounds} rounds × {len(cases())} cases, sequence {args.seq}, {HEADS} heads × {HEAD_DIM}, fp32, "
          f"causal, on cp = {', '.join(map(str, DEGREES))} gloo processes")
    with tempfile.TemporaryDirectory() as tmp:
        for cp in DEGREES:
            rows += case_rows(cp, per_case(run_workers(Path(tmp) / f"cp{cp}", cp, args)))
    print_rows(rows)
    settings = {"rounds": args.rounds, "seq": args.seq, "repeats": args.repeats, "quick": args.quick, "heads": HEADS,
                "head_dim": HEAD_DIM, "dtype": "float32", "causal": True, "degrees": list(DEGREES),
                "wall_s": round(time.perf_counter() - started, 1), "cores": os.cpu_count(),
                "load_average_1min": os.getloadavg()[0]}
    print(f"results: appended to {write_results('context_parallel', rows, settings, table='context_parallel')}")


if __name__ == "__main__":
    main()
