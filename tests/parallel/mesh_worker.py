"""One rank of the mesh test (tests/parallel/test_mesh.py), started by torchrun on gloo.

Builds the rank grid of degrees (dp, pp, tp, cp) given on the command line, and writes what this rank saw to
OUT/rankN.json: its groups' members, sums over each axis, a data-parallel strategy's averaged gradient,
and the loader's sample indices for its dp coordinate.
"""
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from labkit.data.loader import ShardedLoader
from labkit.distributed import DistEnv
from labkit.parallel.dp.ddp import NaiveDDP
from labkit.parallel.mesh import AXES, FLATTENED, ParallelDims, build_grid

dp, pp, tp, cp, dp_shard, out = *map(int, sys.argv[1:6]), sys.argv[6]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
grid = build_grid(ParallelDims(dp, pp, tp, cp, dp_shard), rank, "cpu")
GROUPS = (*AXES, *FLATTENED)  # the axes, and the flattened ones (dp, the gradient axis, the shard axis)
seen = {"coordinate": [grid.coord(a) for a in AXES],
        "mesh_coordinate": list(grid.device_mesh.get_coordinate()),
        "groups": {a: dist.get_process_group_ranks(grid.group(a)) for a in GROUPS},
        "sums": {}}
for axis in GROUPS:  # each rank contributes its global rank: the sum is over the axis's members only
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=grid.group(axis))
    seen["sums"][axis] = value.item()

# A data-parallel strategy averages over the gradient axis (dp × cp) only: gradient = this rank's number
env = DistEnv(rank, world, rank, world, "cpu", "gloo", 1, grid)
cfg = SimpleNamespace(parallel=SimpleNamespace(dp=SimpleNamespace(bucket_mb=1.0)))
strategy = NaiveDDP(cfg, env)
model = torch.nn.Linear(2, 1, bias=False)
with torch.no_grad():
    model.weight.fill_(float(rank))  # differs per rank: wrap copies the first dp replica's weights
module = strategy.wrap(model)
model.weight.grad = torch.full_like(model.weight, float(rank))
strategy.sync_gradients(module)
seen["weight_after_wrap"] = model.weight[0, 0].item()
seen["averaged_grad"] = model.weight.grad[0, 0].item()

# The loader shards by dp coordinate: ranks with the same one read the same samples
loader = ShardedLoader(list(range(64)), 2, grid.coord("dp"), grid.size("dp"), 1, seed=0)
seen["indices"] = loader.next_indices().tolist()

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads ("terminate called ...")
