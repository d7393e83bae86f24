"""Gradient compression: fewer bytes on the wire for an approximate average gradient.

Data parallelism pays one all-reduce of the whole gradient per step — every rank sends about
twice the model size. When the network is the bottleneck we can send less, in three ways:

=============  =========================================  ===============  ================
compressor     what it sends (per rank, n fp32 entries)   collective       error feedback
=============  =========================================  ===============  ================
``none``       n × 4 bytes                                all-reduce       —
``fp16/bf16``  n × 2 bytes (fewer bits per entry)         all-reduce       —
``powersgd``   (rows + cols)·r × 4 (low-rank factors)     all-reduce ×2    yes
``topk``       k values + k indices (fewest entries)      all-gather       yes
``sign``       n / 8 bytes + 1 scale (one bit an entry)   all-gather       yes
``randomk``    k values at shared random indices          all-reduce       no (the contrast)
=============  =========================================  ===============  ================

The idea that makes aggressive compression work is **error feedback** (Seide et al. 2014;
Karimireddy et al. 2019): whatever a rank did not send this step is remembered and added to the
next step's gradient. Nothing is thrown away, only delayed — after T steps,

    sum of applied updates = sum of true gradients − current error,

and since the error stays bounded while both sums grow, the optimiser follows the right path.

Each compressor is declared once, in its own module, and registers itself in ``COMPRESSORS``
(:mod:`labkit.registry`) with its config options and facts. Use ``build_compressor(name, timer=..., **options)``;
then either ``compressor.allreduce(i, flat)`` for a flat bucket or ``ddp.register_comm_hook(*compressor.ddp_hook())``
for torch's DDP, and read ``compressor.collect_stats()`` once a step.
"""
from __future__ import annotations

from labkit.comm.compress.base import COMPRESSORS, Compressor, compressed_allreduce_hook
from labkit.comm.compress.half import BF16, FP16
from labkit.comm.compress.none import NoCompression
from labkit.comm.compress.powersgd import PowerSGD
from labkit.comm.compress.randomk import RandomK
from labkit.comm.compress.sign import SignSGD
from labkit.comm.compress.topk import TopK
from labkit.metrics.timers import CommTimer
from labkit.registry import import_submodules

import_submodules(__name__, __path__)  # each module registers its compressors in COMPRESSORS: a new one is a new file


def build_compressor(name: str, timer: CommTimer | None = None, group=None, **options) -> Compressor:
    """The compressor called ``name``, counting into ``timer`` (a fresh one if None).

    Raises ``ValueError`` naming the bad name or option and how to fix it.
    """
    return COMPRESSORS.get(name)(timer if timer is not None else CommTimer(), group=group, **options)


__all__ = ["COMPRESSORS", "build_compressor", "Compressor", "compressed_allreduce_hook", "NoCompression",
           "FP16", "BF16", "PowerSGD", "TopK", "SignSGD", "RandomK"]
