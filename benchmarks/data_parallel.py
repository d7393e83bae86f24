"""Step time, exposed communication, bytes and measured peak memory of every data-parallel strategy.

Same model (~10M parameters), same batch, 2 gloo processes. All variants run inside one process
group, interleaved round by round in rotating order, so machine noise hits each alike. Step time
is the mean over steady-state steps; ratios are to torch_ddp. Each run tracks one step's
allocations (``labkit.metrics.memory``): the peak of its forward, backward (with the gradient
synchronisation) and optimizer step, per rank. Checks, each printed and recorded:

* ddp_bucketed ≤ 1.15× torch_ddp, and faster than ddp_naive (timings: this machine's);
* ZeRO-1 sends exactly DDP's bytes (the paper's P_os: reduce-scatter + all-gather), ZeRO-2 too;
* ZeRO-2's exposed communication below ZeRO-1's (it reduce-scatters from backward; ZeRO-1 after it);
* ZeRO-2's peak gradient bytes ≈ Ψ/p + one bucket (within 10%), with buckets small beside Ψ/p
  (``zero2_1mb``: 1 MB buckets, a 20 MB slice).

The table is appended to ``benchmarks/results/data_parallel.jsonl``.

    .venv/bin/python benchmarks/data_parallel.py [--rounds 3] [--steps 8] [--nproc 2] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from labkit.parallel import STRATEGIES as REGISTERED
from labkit.results import write_results

STRATEGIES = list(REGISTERED)  # every registered data-parallel strategy, in option-list order
EXTRA = {"zero2_1mb": ("zero2", {"parallel.dp.bucket_mb": 1.0})}  # ZeRO-2 with buckets small beside Ψ/p
VARIANTS = STRATEGIES + list(EXTRA)
WARMUP = 2
NORM_BYTES = 8  # ZeRO's gradient norm: one float64 summed over the replicas, counted with the gradients
MODEL = {"model.n_layer": 8, "model.n_head": 8, "model.n_embd": 320, "model.block_size": 64}
QUICK_MODEL = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 32}


def overrides(variant: str, steps: int, quick: bool = False) -> dict:
    strategy, extra = EXTRA.get(variant, (variant, {}))
    return {"run.name": variant, "run.steps": steps, "run.eval_every": 0, "run.save_final": False,
            **(QUICK_MODEL if quick else MODEL), "data.batch_size": 8, "data.micro_batch_size": 4,
            "parallel.dp.strategy": strategy, "parallel.dp.bucket_mb": 0.01 if quick else 4.0,
            "metrics.progress": False, **extra}


def round_order(r: int) -> list[str]:
    return VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]


def worker(out: Path, rounds: int, steps: int, quick: bool) -> None:
    import torch.distributed as dist

    from labkit.config import load_config
    from labkit.distributed import init_distributed, shutdown_distributed
    from labkit.train import train

    init_distributed(load_config(None, overrides("torch_ddp", steps, quick)))
    for r in range(rounds):
        for variant in round_order(r):
            train(load_config(None, overrides(variant, steps, quick)), out / f"{variant}-{r}")
            dist.barrier()
    shutdown_distributed()
    sys.stdout.flush()
    os._exit(0)  # as labkit's workers do: no C++ destructors racing the backend's threads


def step_events(run_dir: Path) -> list[dict]:
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else float("nan")


def tracked_peaks(events: list[dict]) -> dict:
    """The tracked step's peak bytes per phase, the largest over ranks (None where no step was tracked)."""
    out = {}
    for phase in ("forward", "backward", "optimizer"):
        values = [v for e in events for v in (e.get(f"rank_peak_{phase}_bytes") or []) if v is not None]
        out[f"peak_{phase}"] = max(values) if values else None
    return out


def measure(out: Path, rounds: int) -> dict[str, dict]:
    """One row per variant: means over the steady steps of every round, bytes and memory of the last step."""
    rows = {}
    for v in VARIANTS:
        runs = [step_events(out / f"{v}-{r}") for r in range(rounds)]
        steady = [e for events in runs for e in events[WARMUP:]] or [e for events in runs for e in events]
        last = steady[-1]
        grad_peaks = [p for events in runs for e in events for p in (e.get("rank_grad_peak_bytes") or []) if p]
        rows[v] = {"step_s": mean(e["step_time_s"] for e in steady), "comm_s": mean(e["comm_s"] for e in steady),
                   "exposed_s": mean(e["comm_exposed_s"] for e in steady), "bytes": last["comm_bytes"],
                   "param": last["param_bytes"], "grad": last["grad_bytes"], "opt": last["optimizer_bytes"],
                   "grad_peak": max(grad_peaks) if grad_peaks else None, **tracked_peaks(runs[0])}
    return rows


def checks(rows: dict[str, dict], psi: int, nproc: int, bucket_bytes: dict[str, float]) -> list[dict]:
    """The benchmark's claims, each with the numbers it rests on and whether it held."""
    ddp, base = rows["ddp_naive"]["bytes"], rows["torch_ddp"]["step_s"]
    bucketed, naive, zero1, zero2 = (rows[v] for v in ("ddp_bucketed", "ddp_naive", "zero1", "zero2"))
    small = rows["zero2_1mb"]
    slice_bytes = psi * 4 / nproc
    target = slice_bytes + bucket_bytes["zero2_1mb"]
    return [
        {"check": "ddp_bucketed / torch_ddp step time", "value": bucketed["step_s"] / base, "target": "≤ 1.15",
         "held": bucketed["step_s"] / base <= 1.15},
        {"check": "ddp_bucketed / ddp_naive step time", "value": bucketed["step_s"] / naive["step_s"],
         "target": "< 1", "held": bucketed["step_s"] < naive["step_s"]},
        {"check": "zero1 bytes = DDP bytes", "value": zero1["bytes"], "ddp": ddp, "target": f"± {NORM_BYTES} B",
         "held": abs(zero1["bytes"] - ddp) <= NORM_BYTES},
        {"check": "zero2 bytes = DDP bytes", "value": zero2["bytes"], "ddp": ddp, "target": f"± {NORM_BYTES} B",
         "held": abs(zero2["bytes"] - ddp) <= NORM_BYTES},
        {"check": "zero2 exposed < zero1 exposed", "value": zero2["exposed_s"], "zero1": zero1["exposed_s"],
         "target": "<", "held": zero2["exposed_s"] < zero1["exposed_s"]},
        {"check": "zero2 peak gradient bytes ≈ Ψ/p + one bucket", "value": small["grad_peak"], "slice": slice_bytes,
         "bucket": bucket_bytes["zero2_1mb"], "ratio": small["grad_peak"] / target, "target": "within 10%",
         "held": abs(small["grad_peak"] / target - 1) <= 0.10},
    ]


def _mb(value) -> str:
    return "n/a" if value is None or value != value else f"{value / 1e6:.2f}"


def report(out: Path, rounds: int, nproc: int, quick: bool = False) -> tuple[list[dict], list[dict], int]:
    """Prints the table and the checks; returns the rows, the checks and the model's parameter count."""
    from labkit.parallel.report import predict_rank_memory

    rows = measure(out, rounds)
    psi = json.loads((out / "torch_ddp-0" / "events.jsonl").read_text().splitlines()[0])["params"]["total"]
    base = rows["torch_ddp"]["step_s"]
    ring = 2 * (nproc - 1) / nproc * psi * 4
    print(f"model: {psi / 1e6:.2f} M parameters, {nproc} gloo processes, {rounds} interleaved rounds")
    print(f"analytic all-reduce volume per rank 2(p-1)/p·Ψ·4 B = {ring / 1e6:.2f} MB; ZeRO-3 ≈ 1.5× that\n")
    print(f"{'variant':13s} {'step ms':>8s} {'× ddp':>6s} {'comm ms':>8s} {'exposed':>8s} {'MB sent':>8s} "
          f"{'× ring':>6s} {'p/g/o MB held':>16s} {'predicted':>16s} {'peak fwd/bwd/opt MB':>21s} {'grad peak':>9s}")
    for v, r in rows.items():
        pred = predict_rank_memory(psi, nproc, EXTRA.get(v, (v,))[0])
        held = f"{_mb(r['param'])}/{_mb(r['grad'])}/{_mb(r['opt'])}"
        predicted = f"{_mb(pred.parameters)}/{_mb(pred.gradients)}/{_mb(pred.optimizer_state)}"
        peaks = "/".join(_mb(r[f"peak_{phase}"]) for phase in ("forward", "backward", "optimizer"))
        exposed = "n/a" if r["exposed_s"] != r["exposed_s"] else f"{1e3 * r['exposed_s']:.1f}"
        print(f"{v:13s} {1e3 * r['step_s']:8.1f} {r['step_s'] / base:6.2f} {1e3 * r['comm_s']:8.1f} {exposed:>8s} "
              f"{r['bytes'] / 1e6:8.2f} {r['bytes'] / ring:6.2f} {held:>16s} {predicted:>16s} {peaks:>21s} "
              f"{_mb(r['grad_peak']):>9s}")
    buckets = {v: overrides(v, 1, quick)["parallel.dp.bucket_mb"] * 2**20 for v in VARIANTS}
    found = checks(rows, psi, nproc, buckets)
    print()
    for c in found:
        value = c["value"] if not isinstance(c["value"], float) else f"{c['value']:.4g}"
        print(f"{'held  ' if c['held'] else 'MISSED'} {c['check']}: {value} (target {c['target']})"
              + (f", ratio {c['ratio']:.3f}" if "ratio" in c else ""))
    return ([{"variant": v, **r, "step_vs_torch_ddp": r["step_s"] / base, "bytes_vs_ring": r["bytes"] / ring}
             for v, r in rows.items()], found, psi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round of 4 steps (for the tests)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 4
    if args.worker:
        return worker(Path(args.worker), args.rounds, args.steps, args.quick)
    from labkit.launcher import free_port

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc)), "LABKIT_PROGRESS": "0"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__,
                        "--worker", out, "--rounds", str(args.rounds), "--steps", str(args.steps)]
                       + (["--quick"] if args.quick else []), check=True, env=env, timeout=3000)
        rows, found, params = report(Path(out), args.rounds, args.nproc, args.quick)
    shape = {k: v for k, v in overrides("torch_ddp", args.steps, args.quick).items()
             if k.startswith(("model.", "data.", "parallel."))}
    settings = {"rounds": args.rounds, "steps": args.steps, "nproc": args.nproc, "warmup_steps": WARMUP,
                "params": params, "shape": shape, "quick": args.quick, "extra_variants": EXTRA}
    path = write_results("data_parallel", rows, settings, table="data_parallel")
    write_results("data_parallel", found, settings, table="checks")
    print(f"results: appended to {path}")


if __name__ == "__main__":
    main()
