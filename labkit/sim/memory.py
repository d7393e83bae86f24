"""The step model's memory per GPU: what a rank keeps for the whole step, and what one layer needs while it runs.

**Kept** is :func:`labkit.memory_estimate.estimate_memory` for the same layout: labkit's parameter count split evenly
over tp·pp, ZeRO's sharding over dp·cp (the ranks that hold the same parameters), ceil(L/pp) layers of Korthikanti et
al.'s activation bytes (bf16) for the rank's seq/cp tokens, the activations times the micro-batches the first stage
holds in flight (:func:`in_flight`).

**One layer's working set** (:func:`working_memory`), at the peak, the backward of a layer:

* ZeRO-3 (FSDP) gathers the layer's weights whole before it runs (2 bytes a parameter in bf16, its 1/tp slice under
  tensor parallelism) and produces the layer's whole gradient before the reduce-scatter shards it: the **gathered
  layer** and **its gradient**, each the size of one layer's weights. (Prefetching the next layer, as DeepSpeed and
  FSDP may, would add another; not counted.)
* Under recomputation the layer's forward runs again just before its backward and keeps, for that backward, what a
  layer without recompute keeps: the **recompute working set** is one layer's activations without recompute (the
  same Korthikanti et al. counts) less what the recompute already kept for it.

The logits' activations (s·b·V per micro-batch), the CUDA context and the allocator's fragmentation are not counted.
"""
from __future__ import annotations

from labkit.memory_estimate import MemoryPlan, activation_bytes_per_layer, estimate_memory
from labkit.sim.layout import PRECISIONS, Layout, ModelShape


def block_params(shape: ModelShape) -> int:
    """Parameters of all transformer blocks (labkit's count): the matmuls recomputation reruns."""
    from labkit.model import flops  # lazy: it imports torch through labkit.model.gpt

    return shape.layers * flops.count_params(shape.gpt_fields())["per_block"]


def total_params(shape: ModelShape) -> int:
    """All parameters, labkit's count (the token embedding shared with the output layer)."""
    from labkit.model import flops

    return flops.count_params(shape.gpt_fields())["total"]


def in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first stage holds at once: m (GPipe), min(p, m) (1F1B).
    Interleaving keeps a little more (Narayanan et al. 2021, §2.2.2); it is counted as 1F1B here."""
    if layout.pp == 1:
        return 1
    return layout.micro_batches if layout.schedule == "gpipe" else min(layout.pp, layout.micro_batches)


def layer_activation_bytes(shape: ModelShape, layout: Layout, recompute: str) -> float:
    """One layer's activation bytes, one micro-batch, under ``recompute`` (Korthikanti et al.; the layout's tp, SP and
    cp)."""
    return activation_bytes_per_layer(shape.seq, layout.micro_batch, shape.hidden, shape.heads, layout.tp,
                                      recompute, layout.sequence_parallel, layout.cp)


def working_memory(shape: ModelShape, layout: Layout, precision: str = "bf16") -> dict:
    """Bytes one layer needs while it runs, on top of what is kept (see the module): ZeRO-3's gathered layer and its
    gradient, and the recompute working set."""
    layer = block_params(shape) / shape.layers / layout.tp * PRECISIONS[precision] if layout.zero == 3 else 0.0
    rebuilt = (layer_activation_bytes(shape, layout, "none") - layer_activation_bytes(shape, layout, layout.recompute))
    return {"gathered_layer": layer, "layer_gradient": layer, "recompute": rebuilt}


def rank_memory(shape: ModelShape, layout: Layout, precision: str = "bf16") -> dict:
    """Bytes per GPU by part: what is kept (:func:`labkit.memory_estimate.estimate_memory` for the same layout, the
    activations times the micro-batches in flight) plus one layer's working set (:func:`working_memory`): the
    gathered layer counted with the parameters, its gradient with the gradients, the recompute working set with
    the activations. Under expert parallelism a rank holds E/ep of each layer's experts (:mod:`labkit.sim.experts`)."""
    from labkit.sim.experts import expert_parameters

    plan = MemoryPlan(params=total_params(shape) - expert_parameters(shape, layout.ep), n_layer=shape.layers,
                      hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab, seq_len=shape.seq,
                      micro_batch=layout.micro_batch, precision="fp32" if precision == "fp32" else "mixed",
                      dp=layout.gradient_ranks, zero_stage=layout.zero, tp=layout.tp, pp=layout.pp,
                      recompute=layout.recompute, sequence_parallel=layout.sequence_parallel, cp=layout.cp)
    est, work = estimate_memory(plan), working_memory(shape, layout, precision)
    return {"parameters": est.parameters + work["gathered_layer"], "gradients": est.gradients + work["layer_gradient"],
            "optimizer": est.optimizer_state, "activations": est.activations * in_flight(layout) + work["recompute"]}
