"""Gradient compressors as the step model sees them: one number, the ratio of wire bytes they save.

The step model knows a compressor only through ``Layout.grad_compression``: the data-parallel gradient
bytes on the wire are divided by it (:func:`labkit.sim.step.dp_seconds`). This module works that ratio out
for labkit's compressors (:mod:`labkit.comm.compress`) on a given model, from each compressor's own defaults:

* **fp16 / bf16** send every entry in 2 bytes: the model's wire element (4 bytes in fp32, 2 in bf16) ÷ 2 —
  so under bf16 training they gain nothing: the model already sends 2-byte gradients.
* **PowerSGD** sends, for each n × m weight matrix it compresses, two factors of (n + m)·r entries (both
  all-reduced), and everything else whole: ratio = all entries ÷ those sent. A matrix is compressed when
  (n + m)·r·min_compression_rate < n·m, as the compressor decides; r is its default rank.
* **top-k** sends its 1% of entries *with an int32 index each*, by all-gather: every rank receives every
  other rank's pairs, so its bytes grow with the ranks while the all-reduce's do not. The ratio is the ring
  all-reduce's bytes ÷ the ring all-gather's (:func:`labkit.comm.network.collective_cost`); at 128 ranks it
  is below 1 — more bytes than no compression at all.

What a ratio leaves out: the number of collectives and their latency (the model keeps the uncompressed
buckets' count; PowerSGD runs two all-reduces where the plain one ran one), and the compressor's own compute
(PowerSGD's matmuls and orthogonalisation, top-k's selection). So the modelled gain is an upper bound.
"""
from __future__ import annotations

import math
from typing import Optional

from labkit.comm.network import collective_cost
from labkit.sim.step import PRECISIONS, ModelShape, total_params


def weight_matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """The (n, m) of each weight matrix of a GPT: per block QKV, attention output, MLP in and out; the token and
    position embeddings. The rest (layer norms) are vectors."""
    h = shape.hidden
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)] * shape.layers + [(shape.vocab, h), (shape.seq, h)]


def half(shape: ModelShape, dp: int, precision: str) -> float:
    """fp16 / bf16 gradients: 2 bytes per entry instead of the model's wire element."""
    return PRECISIONS[precision] / 2


def powersgd(shape: ModelShape, dp: int, precision: str) -> float:
    """All gradient entries ÷ those PowerSGD sends at its default rank."""
    from labkit.comm.compress.powersgd import PowerSGD

    r, rate = PowerSGD.defaults["rank"], PowerSGD.defaults["min_compression_rate"]
    total = sent = total_params(shape)
    for n, m in weight_matrices(shape):
        if (n + m) * r * rate < n * m:
            sent -= n * m - (n + m) * r
    return total / sent


def topk(shape: ModelShape, dp: int, precision: str) -> float:
    """The all-reduce's ring bytes ÷ top-k's all-gather of every rank's kept (value, int32 index) pairs."""
    from labkit.comm.compress.topk import TopK

    n, elem = total_params(shape), PRECISIONS[precision]
    kept = math.ceil(TopK.defaults["ratio"] * n)
    plain = collective_cost("all_reduce", n * elem, dp).bytes
    gathered = collective_cost("all_gather", dp * kept * (elem + 4), dp).bytes
    return plain / gathered if gathered else 1.0


RATIOS = {"none": lambda shape, dp, precision: 1.0, "fp16": half, "bf16": half, "powersgd": powersgd, "topk": topk}


def wire_ratio(name: str, shape: ModelShape, dp: int, precision: str) -> Optional[float]:
    """Uncompressed ÷ compressed wire bytes of compressor ``name`` on ``shape``'s gradients over ``dp`` ranks;
    below 1 when it sends more; None for a compressor this module has no rule for."""
    rule = RATIOS.get(name)
    return None if rule is None else rule(shape, dp, precision)
