"""A model built and trained under a per-process memory cap: ``torchrun ... memory_cap_worker.py OUT OVERRIDES``.

Used by benchmarks/memory_cap.py and tests/parallel/test_memory_cap.py (the cap is the launcher's ``RLIMIT_DATA``,
inherited by every process). Each rank

1. builds the trainer as labkit's loop does (:func:`labkit.train.build_trainer`: the GPT on the meta device,
   this rank's part made real) and reads, from the kernel, its resident set before and its peak after;
2. drops it and trains with labkit's own loop (:func:`labkit.train.train`, ``OUT/run``);

then writes ``OUT/rank{r}.json``: those resident sets (``VmRSS``, ``VmHWM`` of ``/proc/self/status``), the peak
of the whole run, its data segment (``VmData``: what ``RLIMIT_DATA`` caps) and the cap. The run's events hold
what each rank's part is predicted and measured to hold (``labkit.parallel.reports.layout.rank_memory``).
"""
import gc
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.config import load_config, resolve_auto
from labkit.data import build_datasets
from labkit.distributed import init_distributed, shutdown_distributed
from labkit.train import build_trainer, train


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (the kernel's count, in KiB there)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def start_up(cfg, env) -> dict:
    """The resident set before and at its peak after this rank builds its part of the model."""
    cfg, _ = resolve_auto(cfg)
    torch.manual_seed(cfg.run.seed)
    train_ds, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                               cfg.data.val_fraction)
    with torch.device("meta"):  # a fixed cost paid once, whatever the model: torch's meta kernels load (~150 MB)
        torch.nn.Embedding(2, 2)
    before = status_bytes("VmRSS")
    trainer = build_trainer(cfg, env, train_ds, tokenizer.vocab_size)
    built = {"rss_before_build_bytes": before, "peak_rss_after_build_bytes": status_bytes("VmHWM")}
    trainer.strategy.close()
    del trainer
    gc.collect()
    return built


out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
cfg = load_config(None, overrides)
env = init_distributed(cfg)
record = {"rank": env.rank, "world": env.world_size, "data_limit_bytes": resource.getrlimit(resource.RLIMIT_DATA)[0],
          **start_up(cfg, env)}
dist.barrier()
train(cfg, out / "run")
dist.barrier()
record.update(peak_rss_bytes=status_bytes("VmHWM"), data_bytes=status_bytes("VmData"))
(out / f"rank{env.rank}.json").write_text(json.dumps(record))
shutdown_distributed()
sys.stdout.flush()
os._exit(0)
