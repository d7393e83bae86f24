"""Parallel strategies, chosen by ``parallel.dp.strategy`` (interface: ``labkit.parallel.base``).

| strategy       | written by | gradients synchronised by          | sharded                   |
|----------------|------------|------------------------------------|---------------------------|
| `torch_ddp`    | PyTorch    | bucketed all-reduce in backward    | nothing                   |
| `ddp_naive`    | labkit     | one all-reduce per parameter after | nothing                   |
| `ddp_bucketed` | labkit     | bucketed all-reduce in backward    | nothing                   |
| `zero1`        | labkit     | bucketed reduce-scatter in backward | optimizer state          |
| `zero2`        | labkit     | bucketed reduce-scatter in backward | optimizer state, grads   |
| `zero3`        | labkit     | reduce-scatter per unit in backward | everything (ZeRO-3)      |
| `fsdp2`        | PyTorch    | reduce-scatter in backward         | everything (ZeRO-3)       |

Each is declared once, in its own module, and registers itself in ``STRATEGIES``; ``comm.sync``'s
local SGD and DiLoCo (:mod:`labkit.parallel.local_sgd`) register in ``SYNC_STRATEGIES`` and replace
per-step synchronisation. What a strategy declares (ZeRO stage, wire volume, what it combines
with, its config checks) is listed in :mod:`labkit.parallel.spec`. ``parallel.dp.strategy: auto`` (the
shipped configs') takes the first of them, in this order, that combines with the model-parallel layout
(:func:`labkit.parallel.layout_checks.auto_strategy`; the launch says which and why).

Every strategy works on the ``dp`` axis of the rank grid (:mod:`labkit.parallel.mesh`). Model
partitioning splits the model over the other axes, applied in one place (:mod:`labkit.parallel.parallelize`):

| axis | key           | labkit's, from scratch                              | torch's, beside it                 |
|------|---------------|-----------------------------------------------------|------------------------------------|
| `tp` | `parallel.tp` | `tensor` (layers), `tensor_model` (the GPT), `sequence` | `tensor_dtensor` (DTensor plan) |
| `pp` | `parallel.pp` | `pipeline` (GPipe, 1F1B over send/recv)             | `pipeline_torch` (pipelining)      |

What a layout needs of the model and which strategies combine with it: :mod:`labkit.parallel.layout_checks`;
what a split run measured beside the theory (bubble, bytes per layer, memory per rank, the step's split):
:mod:`labkit.parallel.layout_report`.
"""
from labkit.parallel.spec import EVERY_STEP, STRATEGIES, SYNC_STRATEGIES, sync_modes
from labkit.parallel.zero import ShardedOptimizer
from labkit.registry import import_submodules

import_submodules(__name__, __path__)  # each module registers its strategies: a new one is a new file


def build_strategy(cfg, env):
    if cfg.comm.sync != EVERY_STEP:  # communicating less often replaces per-step gradient sync
        return SYNC_STRATEGIES.get(cfg.comm.sync)(cfg, env)
    return STRATEGIES.get(cfg.parallel.dp.strategy)(cfg, env)


__all__ = ["STRATEGIES", "SYNC_STRATEGIES", "EVERY_STEP", "sync_modes", "build_strategy", "ShardedOptimizer"]
