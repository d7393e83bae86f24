"""Dropout masks of a split model, one step each: ``torchrun --nproc-per-node 4 rng_worker.py OUT CASES``.

Used by test_rng.py. For each case (JSON: name, overrides) every rank builds the trainer
(:func:`labkit.train.build_trainer`), rank 0 alone draws from torch's default generator (as it does when it times
a matmul for the peak), and one training step runs with a hook on every dropout recording where its first
output is zero. Rank 0 writes ``OUT/{name}.json``: each rank's grid coordinate and, per dropout, a digest of
its mask and the fraction it dropped.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.config import load_config
from labkit.data import build_datasets
from labkit.distributed import init_distributed, shutdown_distributed
from labkit.parallel.rng import TrackedDropout
from labkit.train import build_trainer


def masks_of_one_step(cfg) -> dict:
    env = init_distributed(cfg)  # this case's grid (the process group is joined once)
    torch.manual_seed(cfg.run.seed)
    train_ds, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                               cfg.data.val_fraction)
    trainer = build_trainer(cfg, env, train_ds, tokenizer.vocab_size)
    if env.rank == 0:
        torch.randn(1000)  # a draw one rank makes alone: replicated masks must not depend on it
    masks = {}

    def record(name):
        def hook(module, inputs, output):
            if name not in masks:
                zero = (output == 0).cpu().numpy()
                masks[name] = {"digest": hashlib.sha1(zero.tobytes()).hexdigest(), "dropped": float(zero.mean()),
                               "region": module.region}
        return hook
    dropouts = [(n, m) for n, m in trainer.model.named_modules() if isinstance(m, TrackedDropout)]
    for name, module in dropouts:
        module.register_forward_hook(record(name))
    trainer.step(trainer.batches())
    trainer.strategy.close()
    return {"coord": env.grid.dims.coordinate(env.rank), "masks": masks, "tracked": len(dropouts)}


out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
for case in cases:
    mine = masks_of_one_step(load_config(None, case["overrides"]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        (out / f"{case['name']}.json").write_text(json.dumps(every))
    dist.barrier()
shutdown_distributed()
sys.stdout.flush()
os._exit(0)
