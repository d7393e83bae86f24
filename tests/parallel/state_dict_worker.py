"""One rank of the full-state-dict test (tests/parallel/test_full_state_dict.py), started by torchrun on gloo.

Builds a tiny GPT, shards it with FSDP2 and writes OUT/rankN.pt: the weights before sharding (every rank
starts from the same seed), then ``full_state_dict`` in both modes — rank 0 only (saving) and everywhere
(comparing).
"""
import os
import sys

import torch
import torch.distributed as dist

from labkit.config import load_config
from labkit.distributed import init_distributed
from labkit.model import GPT, GPTShape
from labkit.parallel import build_strategy

out = sys.argv[1]
cfg = load_config(None, {"parallel.dp.strategy": "fsdp2", "run.device": "cpu", "run.threads_per_proc": 1,
                         "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16})
env = init_distributed(cfg)
torch.manual_seed(0)
model = GPT(GPTShape.from_config(cfg.model, 64, "naive"))
before = {k: v.detach().clone() for k, v in model.state_dict().items()}
strategy = build_strategy(cfg, env)
module = strategy.wrap(model)
sharded = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items() if hasattr(v, "to_local")}
seen = {"before": before, "sharded": sharded,
        "rank0": strategy.full_state_dict(module),
        "everywhere": strategy.full_state_dict(module, everywhere=True)}
torch.save(seen, os.path.join(out, f"rank{env.rank}.pt"))
strategy.close()
del module, model, strategy
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads
