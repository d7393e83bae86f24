"""Parallel strategies, chosen by ``parallel.dp.strategy`` (interface: ``labkit.parallel.base``).

| strategy       | written by | gradients synchronised by          | sharded                   |
|----------------|------------|------------------------------------|---------------------------|
| `torch_ddp`    | PyTorch    | bucketed all-reduce in backward    | nothing                   |
| `ddp_naive`    | labkit     | one all-reduce per parameter after | nothing                   |
| `ddp_bucketed` | labkit     | bucketed all-reduce in backward    | nothing                   |
| `zero1`        | labkit     | bucketed all-reduce in backward    | optimizer state           |
| `zero2`        | labkit     | reduce-scatter after backward      | optimizer state, grads    |
| `fsdp2`        | PyTorch    | reduce-scatter in backward         | everything (ZeRO-3)       |
"""
from labkit.parallel.ddp import BucketedDDP, NaiveDDP
from labkit.parallel.fsdp import FSDP2
from labkit.parallel.torch_ddp import TorchDDP
from labkit.parallel.zero import ShardedOptimizer, Zero1, Zero2

STRATEGIES = {s.name: s for s in (TorchDDP, NaiveDDP, BucketedDDP, Zero1, Zero2, FSDP2)}


def build_strategy(cfg, env):
    if cfg.comm.sync != "every_step":  # communicating less often replaces per-step gradient sync
        from labkit.comm.sync import SYNC_STRATEGIES

        return SYNC_STRATEGIES[cfg.comm.sync](cfg, env)
    try:
        return STRATEGIES[cfg.parallel.dp.strategy](cfg, env)
    except KeyError:
        raise ValueError(f"unknown parallel.dp.strategy {cfg.parallel.dp.strategy!r}; "
                         f"available: {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "build_strategy", "ShardedOptimizer"]
