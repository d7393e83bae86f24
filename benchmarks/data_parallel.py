"""Step time, exposed communication, bytes and memory of every data-parallel strategy.

Same model (~10M parameters), same batch, 2 gloo processes. All strategies run inside one process
group, interleaved round by round in rotating order, so machine noise hits each alike. Step time
is the mean over steady-state steps; ratios are to torch_ddp. Targets: ddp_bucketed ≤ 1.15×
torch_ddp, and ddp_bucketed faster than ddp_naive. The table is appended to
``benchmarks/results/data_parallel.jsonl``.

    .venv/bin/python benchmarks/data_parallel.py [--rounds 3] [--steps 8] [--nproc 2]
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
WARMUP = 2


def overrides(strategy: str, steps: int) -> dict:
    return {"run.name": strategy, "run.steps": steps, "run.eval_every": 0, "run.save_final": False,
            "model.n_layer": 8, "model.n_head": 8, "model.n_embd": 320, "model.block_size": 64,
            "data.batch_size": 8, "data.micro_batch_size": 4, "parallel.dp.strategy": strategy,
            "parallel.dp.bucket_mb": 4.0, "metrics.progress": False}


def worker(out: Path, rounds: int, steps: int) -> None:
    import torch.distributed as dist

    from labkit.config import load_config
    from labkit.distributed import init_distributed, shutdown_distributed
    from labkit.train import train

    init_distributed(load_config(None, overrides("torch_ddp", steps)))
    for r in range(rounds):
        order = STRATEGIES[r % len(STRATEGIES):] + STRATEGIES[: r % len(STRATEGIES)]
        for strategy in order:
            train(load_config(None, overrides(strategy, steps)), out / f"{strategy}-{r}")
            dist.barrier()
    shutdown_distributed()
    sys.stdout.flush()
    os._exit(0)  # as labkit's workers do: no C++ destructors racing the backend's threads


def steady_steps(run_dir: Path) -> list[dict]:
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"][WARMUP:]


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else float("nan")


def report(out: Path, rounds: int, nproc: int) -> tuple[list[dict], int]:
    """Prints the table and the targets; returns one row per strategy and the model's parameter count."""
    from labkit.parallel.report import predict_rank_memory

    rows = {}
    for s in STRATEGIES:
        steps = [e for r in range(rounds) for e in steady_steps(out / f"{s}-{r}")]
        rows[s] = {"step_s": mean(e["step_time_s"] for e in steps), "comm_s": mean(e["comm_s"] for e in steps),
                   "exposed_s": mean(e["comm_exposed_s"] for e in steps), "bytes": steps[-1]["comm_bytes"],
                   "param": steps[-1]["param_bytes"], "grad": steps[-1]["grad_bytes"],
                   "opt": steps[-1]["optimizer_bytes"]}
    psi = json.loads((out / "torch_ddp-0" / "events.jsonl").read_text().splitlines()[0])["params"]["total"]
    base = rows["torch_ddp"]["step_s"]
    ring = 2 * (nproc - 1) / nproc * psi * 4
    print(f"model: {psi / 1e6:.2f} M parameters, {nproc} gloo processes, {rounds} interleaved rounds")
    print(f"analytic all-reduce volume per rank 2(p-1)/p·Ψ·4 B = {ring / 1e6:.2f} MB; ZeRO-3 ≈ 1.5× that\n")
    print(f"{'strategy':13s} {'step ms':>8s} {'× ddp':>6s} {'comm ms':>8s} {'exposed':>8s} {'MB sent':>8s} "
          f"{'× ring':>6s} {'params MB':>10s} {'grads MB':>9s} {'optim MB':>9s}  predicted p/g/o MB")
    for s, r in rows.items():
        pred = predict_rank_memory(psi, nproc, s)
        exposed = "n/a" if r["exposed_s"] != r["exposed_s"] else f"{1e3 * r['exposed_s']:8.1f}"
        print(f"{s:13s} {1e3 * r['step_s']:8.1f} {r['step_s'] / base:6.2f} {1e3 * r['comm_s']:8.1f} {exposed:>8s} "
              f"{r['bytes'] / 1e6:8.2f} {r['bytes'] / ring:6.2f} {r['param'] / 1e6:10.2f} {r['grad'] / 1e6:9.2f} "
              f"{r['opt'] / 1e6:9.2f}  {pred.parameters / 1e6:.1f}/{pred.gradients / 1e6:.1f}/{pred.optimizer_state / 1e6:.1f}")
    bucketed, naive = rows["ddp_bucketed"], rows["ddp_naive"]
    print(f"\nddp_bucketed / torch_ddp step time: {bucketed['step_s'] / base:.2f} (target ≤ 1.15)")
    print(f"ddp_bucketed / ddp_naive step time: {bucketed['step_s'] / naive['step_s']:.2f} (target < 1); "
          f"exposed communication {1e3 * bucketed['exposed_s']:.1f} ms vs {1e3 * naive['exposed_s']:.1f} ms")
    return [{"strategy": s, **r, "step_vs_torch_ddp": r["step_s"] / base, "bytes_vs_ring": r["bytes"] / ring}
            for s, r in rows.items()], psi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.rounds, args.steps)
    from labkit.launcher import free_port

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc)), "LABKIT_PROGRESS": "0"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__,
                        "--worker", out, "--rounds", str(args.rounds), "--steps", str(args.steps)],
                       check=True, env=env)
        rows, params = report(Path(out), args.rounds, args.nproc)
    shape = {k: v for k, v in overrides("torch_ddp", args.steps).items() if k.startswith(("model.", "data."))}
    settings = {"rounds": args.rounds, "steps": args.steps, "nproc": args.nproc, "warmup_steps": WARMUP,
                "params": params, "shape": shape}
    print(f"results: appended to {write_results('data_parallel', rows, settings, table='data_parallel')}")


if __name__ == "__main__":
    main()
