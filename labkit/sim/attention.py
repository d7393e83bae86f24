"""The source text's FlashAttention claim — "attention time cut by 40–60%" — through the step model: modelled.

Attention's time in a step, as :mod:`labkit.sim.step` counts it, on one rank and one micro-batch:

* **the attention core's matmuls**, QKᵀ and A·V: 4·L·d·T FLOPs per token forward, twice that backward, at the
  model's matmul rate for the GPU and these GEMM shapes (:func:`labkit.sim.step.matmul_rate`). The same for both
  kernels.
* **naive** (the s × s scores written to memory, as Megatron-LM ran until 2022): the score kernels stream
  them through HBM (:func:`labkit.sim.step.attention_memory_seconds`).
* **flash** (FlashAttention): no scores in memory, but the backward recomputes QKᵀ: 2·L·d·T FLOPs per token more.

The projections (Q, K, V and the output) are the same matmuls either way and are left out: this is the part of
the step a kernel change can touch. The sequence length barely moves the cut (the matmuls and the scores both
grow as s²; only the GEMMs' tile fit changes with it). The head dimension d = h/a does: the matmuls do 2·d FLOPs
per score, the memory traffic per score
is fixed, so small heads gain more. So does the GPU: the more FLOP/s it has per byte/s of memory bandwidth,
the more the score kernels weigh. Every number here is modelled; ``benchmarks/attention.py`` and
notebook 05 *measure* attention kernels on this machine.
"""
from __future__ import annotations

import dataclasses

from labkit.sim.cluster import cluster
from labkit.sim.layout import PRECISIONS, Layout, ModelShape
from labkit.sim.step import attention_memory_seconds, matmul_rate

LABEL = "modelled (labkit.sim's step model), not measured"
SOURCE_CUT = (0.40, 0.60)  # the source text's claim: FlashAttention cuts attention time by 40-60%


def attention_seconds(shape: ModelShape, layout: Layout, cluster_name: str, precision: str = "bf16") -> dict:
    """Attention-core seconds per micro-batch on one rank, naive and flash, and the cut, as data."""
    gpu = cluster(cluster_name).gpu
    rate = matmul_rate(shape, layout, gpu, precision)
    tokens = layout.micro_batch * shape.seq
    core = 4.0 * shape.layers / layout.pp * shape.hidden * shape.seq * tokens / layout.tp / rate  # forward FLOPs
    score_fwd, score_bwd = attention_memory_seconds(shape, dataclasses.replace(layout, attention="naive"),
                                                    gpu.memory_bandwidth, PRECISIONS[precision])
    naive = 3 * core + score_fwd + score_bwd
    flash = 3 * core + core / 2  # FlashAttention's backward recomputes QKᵀ, half the core's forward
    return {"seq": shape.seq, "cluster": cluster_name, "naive_s": naive, "flash_s": flash, "cut": 1 - flash / naive,
            "in_source_range": SOURCE_CUT[0] <= 1 - flash / naive <= SOURCE_CUT[1], "label": LABEL}


def sweep(shapes: dict[str, ModelShape], clusters=("dgx2h-v100", "dgx-a100", "dgx-h100", "dgx-b200"),
          micro_batch: int = 1) -> list[dict]:
    """:func:`attention_seconds` for each named shape on each cluster (fp16 on the V100, bf16 elsewhere)."""
    return [{"model": name, "head_dim": shape.hidden // shape.heads,
             **attention_seconds(shape, Layout(micro_batch=micro_batch), c, "fp16" if "v100" in c else "bf16")}
            for name, shape in shapes.items() for c in clusters]


def format_sweep(rows: list[dict]) -> str:
    """The sweep as plain text, saying it is modelled and where the source's 40-60% falls."""
    lo, hi = (round(100 * x) for x in SOURCE_CUT)
    lines = [f"FlashAttention's cut of attention time — {LABEL}",
             f"  {'model':<18s} {'head dim':>8s} {'cluster':<12s} {'naive ms':>10s} {'flash ms':>10s} {'cut':>7s}  "
             f"in the source's {lo}–{hi}%"]
    for r in rows:
        lines.append(f"  {r['model']:<18s} {r['head_dim']:>8d} {r['cluster']:<12s} {1e3 * r['naive_s']:>10.2f} "
                     f"{1e3 * r['flash_s']:>10.2f} {100 * r['cut']:>6.1f}%  {'yes' if r['in_source_range'] else 'no'}")
    return "\n".join(lines)
