"""``labkit.sim``: a *model* of training step time and memory on a cluster — arithmetic, not a measurement.

Give it a model shape, a parallel layout and a cluster from the catalog, and it returns the time one
optimizer step would take and the bytes each GPU would hold, term by term: compute, recomputation, the
memory-bound kernels (the attention scores', the blocks' elementwise ones), tensor-parallel, context-parallel and
pipeline communication, the pipeline bubble, data-parallel communication (the part hidden under backward, the part
exposed, and what the hidden part slows) and the memory parts. Every number is a prediction from the α–β
network model (:mod:`labkit.comm.network`), exact FLOP counts (:mod:`labkit.model.flops`) and the
memory formulas (:mod:`labkit.memory_estimate`), the GEMM shapes' tile and wave quantisation
(:mod:`labkit.sim.gemm`), with two fitted constants
(:data:`labkit.sim.step.MATMUL_EFFICIENCY`, :data:`labkit.sim.step.NETWORK_EFFICIENCY`), one derived from a
published point (:data:`labkit.sim.step.V100_MATMUL_EFFICIENCY`) and one published measurement
(:data:`labkit.sim.step.OVERLAP_COST`).
How far the model is from real runs is not hidden: :func:`labkit.sim.validate.validation_table`
compares it, point by point, with published Megatron-LM and ZeRO-3 runs, in sample, and
:mod:`labkit.sim.validate_holdout` with each paper held out (out of sample).

Modules (import what you need; this package imports nothing heavy itself):

* :mod:`labkit.sim.cluster` — the catalog: GPUs, links, clusters, every figure with its source.
* :mod:`labkit.sim.layout` — the vocabulary: a model's shape, a layout, a step's breakdown (data only).
* :mod:`labkit.sim.step` — the step-time model (pure functions); its collectives' costs in
  :mod:`labkit.sim.collective` (NCCL's ring and double binary tree), its memory in :mod:`labkit.sim.memory`, what
  context parallelism (cp) changes in :mod:`labkit.sim.context`. A layout's axes are dp, tp, pp and cp.
* :mod:`labkit.sim.validate` — the published runs and the model's error on each; leave-one-paper-out in
  :mod:`labkit.sim.validate_holdout`, the text of both in :mod:`labkit.sim.validate_report`.
* :mod:`labkit.sim.scenario` — the source text's 128-GPU story (58% → 83% after a 42% cut), modelled.
* :mod:`labkit.sim.attention` — the source text's FlashAttention claim (40–60% of attention time), modelled.
* :mod:`labkit.sim.optimize` — the optimization loop's flowchart walked on a modelled cluster (its
  compressors' wire ratios in :mod:`labkit.sim.compression`, its text and figure in
  :mod:`labkit.sim.optimize_report`).
* :mod:`labkit.sim.checkpointing` — Young/Daly checkpoint intervals at 1,024 GPUs and beyond, modelled.
* :mod:`labkit.sim.budget` — a GPU-hour budget → a compute-optimal model, a layout and a wall clock.
* :mod:`labkit.sim.dryrun` — not a model: labkit's real code run for one rank of a large world on torch's
  *fake* process group (no data moved), recording every collective and the rank's model states against
  the analytic counts (``labkit sim dryrun CONFIG --world 1024``). Its pieces:
  :mod:`labkit.sim.dryrun_record` (the collectives, as launched), :mod:`labkit.sim.dryrun_counts` (the
  analytic counts and the comparison) and :mod:`labkit.sim.dryrun_report` (the text).
"""
