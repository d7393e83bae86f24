"""What does labkit's trainer cost over a bare PyTorch loop?

Same GPT, same batch, same optimizer, one process on the CPU. labkit runs its full trainer in-process
(a process group of one, DDP with the timed communication hook, per-step metrics gathered and written
as JSON lines); the bare loop is the shortest correct loop. Runs alternate (labkit, bare, labkit, …) so
drifts in machine load hit both alike; throughput is wall-clock over the steady-state steps, including
everything labkit does between steps. Target: ratio ≥ 0.97.

    .venv/bin/python benchmarks/overhead.py [--rounds 3] [--steps 40]
"""
from __future__ import annotations

import argparse
import json
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


def benchmark_config(steps: int):
    return load_config(None, {
        "run.name": "overhead", "run.steps": steps, "run.eval_every": 0, "run.save_final": False,
        "model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 128,
        "data.batch_size": 16, "data.micro_batch_size": 16, "metrics.progress": False,
    })


def labkit_tokens_per_s(cfg) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir)
        times = [e["time"] for e in map(json.loads, open(Path(run_dir) / "events.jsonl")) if e["type"] == "step"]
    steady = times[WARMUP:]
    return cfg.data.batch_size * cfg.model.block_size * (len(steady) - 1) / (steady[-1] - steady[0])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cfg = benchmark_config(args.steps)
    ratios = []
    print(f"model: {cfg.model.n_layer} layers × {cfg.model.n_embd} wide, batch {cfg.data.batch_size} × "
          f"{cfg.model.block_size} tokens, {args.steps} steps ({WARMUP} warm-up) per run, {torch.get_num_threads()} threads")
    for r in range(args.rounds):
        if r % 2 == 0:  # ABBA order: neither side always goes first
            labkit_tps, bare_tps = labkit_tokens_per_s(cfg), bare_tokens_per_s(cfg)
        else:
            bare_tps, labkit_tps = bare_tokens_per_s(cfg), labkit_tokens_per_s(cfg)
        ratios.append(labkit_tps / bare_tps)
        print(f"round {r + 1}: labkit {labkit_tps:9.0f} tok/s   bare {bare_tps:9.0f} tok/s   ratio {ratios[-1]:.3f}")
    print(f"throughput ratio labkit/bare: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); target >= 0.97")


if __name__ == "__main__":
    main()
