"""What does labkit's trainer cost over a bare PyTorch loop, and which part of its bookkeeping costs what?

Same GPT, same batch, same optimizer, one process on the CPU. labkit runs its full trainer in-process
(a process group of one, DDP with the timed communication hook, per-step metrics gathered and written
as JSON lines, the anomaly watchdog, the progress bar); the bare loop is the shortest correct loop.
Runs alternate (labkit, bare, bare, labkit, …) so drifts in machine load hit both alike; throughput is
wall-clock over the steady-state steps, including everything labkit does between steps. Target: ratio
≥ 0.97. The trainer times its own bookkeeping by part (``summary["bookkeeping_s_per_step"]``): the
table after the ratios shows each part's milliseconds per step and its share of a bare step, so a
regression names the part that grew. A watchdog alert on a noisy machine starts a profiler capture;
its cost shows under "watchdog".

    .venv/bin/python benchmarks/overhead.py [--rounds 8] [--steps 40]
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/overhead.py   # AVX2 kernels forced on an AVX-512 CPU

``ATEN_CPU_CAPABILITY=avx2`` makes torch run its AVX2 kernels on an AVX-512 machine: that is not an AVX2 machine
(its caches, clocks and oneDNN's own dispatch are the AVX-512 machine's). A record says which it was: the
machine's ISA flags, torch's kernel level, and ``settings.forced_kernels`` (the variable, when it was set).
The target (issue 35): ≥ 8 rounds, the median round ≥ 0.97 and the worst round ≥ 0.90; the bookkeeping
table's parts add up to the measured gap within 1 point of a bare step. Each round's row keeps that round's
bookkeeping by part, so the worst round shows whether labkit's own work grew in it or the machine slowed the run.
``--steps`` sets the window: a stall of the machine of a few tenths of a second moves a 40-step round's ratio by
several points, and a 200-step round's by a fifth as much (both sides alike; the record keeps the setting).

Each run appends its tables to ``benchmarks/results/overhead.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from labkit.config import load_config
from labkit.data import ShardedLoader, build_datasets
from labkit.model import GPT, GPTShape
from labkit.optim import build_optimizer, lr_at, set_lr
from labkit.train import train

WARMUP = 5
FORCING = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # variables that force another ISA's kernels


def benchmark_config(steps: int):
    return load_config(None, {
        "run.name": "overhead", "run.steps": steps, "run.eval_every": 0, "run.save_final": False,
        "model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 128,
        "data.batch_size": 16, "data.micro_batch_size": 16, "metrics.progress": True,
    })


def labkit_tokens_per_s(cfg) -> tuple[float, dict]:
    """Steady-state tokens/s of labkit's trainer, and its bookkeeping seconds per step by part."""
    with tempfile.TemporaryDirectory() as run_dir:
        summary = train(cfg, run_dir)
        times = [e["time"] for e in map(json.loads, open(Path(run_dir) / "events.jsonl")) if e["type"] == "step"]
    steady = times[WARMUP:]
    tps = cfg.data.batch_size * cfg.model.block_size * (len(steady) - 1) / (steady[-1] - steady[0])
    return tps, summary["bookkeeping_s_per_step"]


def bare_tokens_per_s(cfg) -> float:
    torch.manual_seed(cfg.run.seed)
    train_ds, _, tok, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size, 0.1)
    model = GPT(GPTShape.from_config(cfg.model, tok.vocab_size, cfg.attention.backend))
    optimizer = build_optimizer(model, cfg.optim)
    loader = ShardedLoader(train_ds, cfg.data.micro_batch_size, seed=cfg.run.seed)
    for step in range(cfg.run.steps):
        if step == WARMUP:
            start = time.perf_counter()
        set_lr(optimizer, lr_at(step, cfg.optim, cfg.run.steps))
        x, y = loader.next_micro_batch()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    elapsed = time.perf_counter() - start
    return cfg.data.batch_size * cfg.model.block_size * (cfg.run.steps - WARMUP) / elapsed


def bookkeeping_rows(parts_per_round: list[dict], bare_step_s: float) -> list[dict]:
    """Each part's median milliseconds per step over the rounds, and its share of a bare step."""
    names = sorted({name for parts in parts_per_round for name in parts})
    rows = []
    for name in names:
        ms = statistics.median(1000 * parts.get(name, 0.0) for parts in parts_per_round)
        rows.append({"part": name, "ms_per_step": ms, "share_of_bare_step": ms / 1000 / bare_step_s})
    total = sum(row["ms_per_step"] for row in rows)
    return rows + [{"part": "all bookkeeping", "ms_per_step": total, "share_of_bare_step": total / 1000 / bare_step_s}]


MIN_ROUNDS, MEDIAN_TARGET, WORST_TARGET, TABLE_TOLERANCE = 8, 0.97, 0.90, 0.01


def targets(ratios: list[float], table_share: float) -> dict:
    """The issue's targets on the rounds' throughput ratios (labkit/bare) and on the bookkeeping table: the gap
    a median round leaves (labkit's step over a bare one, less 1) against what the table's parts add up to."""
    from labkit.rounds import describe, ratio_summary

    spread = ratio_summary(ratios, lower_is_faster=False)
    gap = 1 / spread["median"] - 1  # labkit's extra time per step, as a share of a bare step
    return {"check": "labkit/bare throughput", "median": spread["median"], "q1": spread["q1"], "q3": spread["q3"],
            "worst": min(ratios), "rounds": ratios, "drifting": spread["drifting"],
            "summary": describe(spread, "labkit/bare"),
            "ratio_held": (len(ratios) >= MIN_ROUNDS and spread["median"] >= MEDIAN_TARGET
                           and min(ratios) >= WORST_TARGET),
            "gap": gap, "table": table_share, "unexplained": gap - table_share,
            "table_held": abs(gap - table_share) <= TABLE_TOLERANCE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < WARMUP + 2:
        parser.error(f"--rounds must be >= 1 and --steps >= {WARMUP + 2} (the first {WARMUP} are warm-up)")
    cfg = benchmark_config(args.steps)
    rounds, parts_per_round = [], []
    print(f"model: {cfg.model.n_layer} layers × {cfg.model.n_embd} wide, batch {cfg.data.batch_size} × "
          f"{cfg.model.block_size} tokens, {args.steps} steps ({WARMUP} warm-up) per run, "
          f"{torch.get_num_threads()} threads, torch kernels at {torch.backends.cpu.get_cpu_capability()}")
    for r in range(args.rounds):
        if r % 2 == 0:  # ABBA order: neither side always goes first
            (labkit_tps, parts), bare_tps = labkit_tokens_per_s(cfg), bare_tokens_per_s(cfg)
        else:
            bare_tps, (labkit_tps, parts) = bare_tokens_per_s(cfg), labkit_tokens_per_s(cfg)
        rounds.append({"round": r + 1, "labkit_tokens_per_s": labkit_tps, "bare_tokens_per_s": bare_tps,
                       "labkit_vs_bare": labkit_tps / bare_tps,
                       # this round's own bookkeeping, so that a bad round says whether labkit's parts grew in it
                       "bookkeeping_ms_per_step": {name: 1000 * s for name, s in parts.items()}})
        parts_per_round.append(parts)
        print(f"round {r + 1}: labkit {labkit_tps:9.0f} tok/s   bare {bare_tps:9.0f} tok/s   "
              f"ratio {rounds[-1]['labkit_vs_bare']:.3f}   bookkeeping {1000 * sum(parts.values()):.2f} ms/step")
    ratios = [row["labkit_vs_bare"] for row in rounds]
    bare_step_s = cfg.data.batch_size * cfg.model.block_size / statistics.median(r["bare_tokens_per_s"] for r in rounds)
    parts = bookkeeping_rows(parts_per_round, bare_step_s)
    print(f"\nlabkit's bookkeeping per step (median over rounds; a bare step takes {1000 * bare_step_s:.1f} ms):")
    for row in parts:
        print(f"  {row['part']:<24} {row['ms_per_step']:8.3f} ms  {row['share_of_bare_step']:7.2%} of a bare step")
    verdict = targets(ratios, parts[-1]["share_of_bare_step"])
    print(f"\nthroughput ratio labkit/bare: {verdict['summary']}")
    print(f"  target: >= {MIN_ROUNDS} rounds, median >= {MEDIAN_TARGET}, worst round >= {WORST_TARGET}: "
          f"{'held' if verdict['ratio_held'] else 'MISSED'} (worst {verdict['worst']:.3f})")
    print(f"  the gap ({verdict['gap']:.2%} of a bare step) against the table's parts ({verdict['table']:.2%}): "
          f"{verdict['unexplained']:+.2%} unexplained, target within ±1 point: "
          f"{'held' if verdict['table_held'] else 'MISSED'}")
    from labkit.results import write_results  # the tables go to benchmarks/results/overhead.jsonl

    settings = {**vars(args), "warmup_steps": WARMUP, "threads": torch.get_num_threads(),
                "forced_kernels": {k: os.environ[k] for k in FORCING if k in os.environ} or None}
    write_results("overhead", rounds, settings, table="overhead")
    write_results("overhead", parts, settings, table="bookkeeping")
    print(f"results: appended to {write_results('overhead', [verdict], settings, table='targets')}")


if __name__ == "__main__":
    main()
