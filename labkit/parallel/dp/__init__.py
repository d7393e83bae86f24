"""Data parallelism: every replica holds the model (or its shard of it) and sees different samples.

Each strategy is one file and registers itself (``labkit.parallel.spec``): :mod:`~labkit.parallel.dp.ddp`
(naive and bucketed all-reduce), :mod:`~labkit.parallel.dp.zero` (ZeRO-1/2, with the sharded optimizer in
:mod:`~labkit.parallel.dp.zero_optimizer`), :mod:`~labkit.parallel.dp.zero3` (labkit's ZeRO-3), and torch's beside
them: :mod:`~labkit.parallel.dp.torch_ddp`, :mod:`~labkit.parallel.dp.fsdp` (FSDP2, HSDP). Local SGD and DiLoCo
(:mod:`~labkit.parallel.dp.local_sgd`) synchronise less often than every step. The interface they share:
:mod:`~labkit.parallel.dp.base`.
"""
from labkit.registry import import_submodules

import_submodules(__name__, __path__)  # each module registers its strategies: a new one is a new file
