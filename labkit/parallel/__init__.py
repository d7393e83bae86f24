"""Parallel strategies, chosen by ``parallel.dp.strategy`` (interface: ``labkit.parallel.dp.base``).

| strategy       | written by | gradients synchronised by          | sharded                   |
|----------------|------------|------------------------------------|---------------------------|
| `torch_ddp`    | PyTorch    | bucketed all-reduce in backward    | nothing                   |
| `ddp_naive`    | labkit     | one all-reduce per parameter after | nothing                   |
| `ddp_bucketed` | labkit     | bucketed all-reduce in backward    | nothing                   |
| `zero1`        | labkit     | bucketed reduce-scatter in backward | optimizer state          |
| `zero2`        | labkit     | bucketed reduce-scatter in backward | optimizer state, grads   |
| `zero3`        | labkit     | reduce-scatter per unit in backward | everything (ZeRO-3)      |
| `fsdp2`        | PyTorch    | reduce-scatter in backward         | everything (ZeRO-3)       |

Each is declared once, in its own module under ``dp/``, and registers itself in ``STRATEGIES``; local SGD and
DiLoCo (:mod:`labkit.parallel.dp.local_sgd`) register in ``SYNC_STRATEGIES`` and replace per-step
synchronisation. What a strategy declares (ZeRO stage, wire volume, what it refuses, its config checks) is listed
in :mod:`labkit.parallel.spec`. ``parallel.dp.strategy: auto`` (the shipped configs') takes the first of them, in
this order, that combines with the model-parallel layout (:func:`labkit.parallel.layout_checks.auto_strategy`; the
launch says which and why).

The package is laid out by axis of the rank grid (:mod:`labkit.parallel.mesh`, whose axes are listed once there):

| folder     | axis | labkit's, from scratch                                   | torch's, beside it          |
|------------|------|----------------------------------------------------------|-----------------------------|
| ``dp/``    | dp   | ``ddp``, ``zero`` (1, 2), ``zero3``, ``local_sgd``       | ``torch_ddp``, ``fsdp`` (FSDP2, HSDP) |
| ``tp/``    | tp   | ``layers``, ``model`` (the GPT), ``sequence``            | ``dtensor`` (DTensor plan)  |
| ``pp/``    | pp   | ``pipeline`` (GPipe, 1F1B over send/recv)                | ``torch_pipelining``        |
| ``cp/``    | cp   | ``ring``, ``allgather``, ``ulysses``                     | torch's ``context_parallel`` (CUDA) |
| ``reports/`` | –  | what runs measured beside the theory                     |                             |

On top of them: :mod:`labkit.parallel.mesh` (the axes and the rank grid), :mod:`labkit.parallel.spec` (what a
strategy declares), :mod:`labkit.parallel.parallelize` (every model-parallel axis applied to the model, in one
place), :mod:`labkit.parallel.layout_checks` (what a layout needs of the model and which strategies combine with
it) and :mod:`labkit.parallel.rng` (dropout masks per axis).
"""
from labkit.parallel.spec import EVERY_STEP, STRATEGIES, SYNC_STRATEGIES, sync_modes
from labkit.parallel.dp.zero import ShardedOptimizer
from labkit.registry import import_submodules

import_submodules(__name__, __path__)  # each module registers its strategies: a new one is a new file


def build_strategy(cfg, env):
    if cfg.comm.sync != EVERY_STEP:  # communicating less often replaces per-step gradient sync
        return SYNC_STRATEGIES.get(cfg.comm.sync)(cfg, env)
    return STRATEGIES.get(cfg.parallel.dp.strategy)(cfg, env)


__all__ = ["STRATEGIES", "SYNC_STRATEGIES", "EVERY_STEP", "sync_modes", "build_strategy", "ShardedOptimizer"]
