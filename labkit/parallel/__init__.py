"""Parallel strategies, chosen by ``parallel.dp.strategy``.

A strategy wraps the model for distributed training and owns gradient synchronisation. Its
interface is small, so the training loop never branches on which one runs:

* ``wrap(model) -> nn.Module`` — returns the module to call (rank 0's weights everywhere);
* ``no_sync(module)`` — a context in which backward does not communicate (for all but the last
  micro-batch of gradient accumulation);
* ``comm_timer`` — the :class:`~labkit.metrics.CommTimer` its collectives report to.
"""
from labkit.parallel.ddp import TorchDDP

STRATEGIES = {"torch_ddp": TorchDDP}


def build_strategy(cfg, env):
    try:
        return STRATEGIES[cfg.parallel.dp.strategy](cfg, env)
    except KeyError:
        raise ValueError(f"unknown parallel.dp.strategy {cfg.parallel.dp.strategy!r}; "
                         f"available: {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "build_strategy", "TorchDDP"]
