"""The optimisation flowchart walked on a simulated cluster: every "measurement" is the step model's prediction.

:mod:`labkit.tuning.runner` walks the flowchart with real runs. Here the same decisions
(:func:`~labkit.tuning.flowchart.classify`, :func:`~labkit.tuning.flowchart.candidate_actions`,
:func:`~labkit.tuning.flowchart.next_node`) are fed by :func:`labkit.sim.step.step_time` instead, so the walk
can be taken on 128 GPUs that nobody owns. Everything it reports is *modelled* (:data:`LABEL`), never measured.

**What the flowchart "measures".** For a step breakdown ``s`` of the model:

* MFU = ``s.mfu`` (model FLOPs, labkit's count, over the job's time and the GPUs' peak at that precision);
* exposed communication = (tp comm + pp comm + dp comm exposed) / step time: what the step waits for on the
  wire (TP and PP collectives sit on the critical path; the DP all-reduce only where backward did not hide
  it), as labkit's timers define exposed (:mod:`labkit.metrics.communication`). Not counted: the bubble (stages
  wait for each other's *compute*) and the overlap slowdown (compute slowed by a hidden collective);
* communication in flight = the exposed terms + the DP communication hidden under backward (shown, not decisive).

**The candidates mapped onto the model.** The flowchart proposes config overrides; each becomes a
:class:`~labkit.sim.step.Layout` field or a precision, or says why the model cannot judge it:

* ``comm.compression`` → ``Layout.grad_compression``, the wire-byte ratio the compressor would achieve on this
  model (:mod:`labkit.sim.compression`: bf16 halves fp32's bytes, PowerSGD sends its low-rank factors; top-k's
  all-gather at 128 ranks sends *more* than the all-reduce, and is rejected without a step). Its compute is
  not modelled: the gain is an upper bound.
* ``comm.sync`` = local SGD / DiLoCo every H steps → ``Layout.sync_every`` = H.
* ``precision.mode`` → the precision: the catalog's bf16 peak, and 2-byte activations and gradients on the wire.
* a model width that fills the tiles → *not judged*: the step model does count how well a layer's GEMMs fill the
  tiles (:mod:`labkit.sim.gemm`), but a new width is a new model (its loss, its FLOPs), not a faster step of this one.
* ``data.micro_batch_size`` / ``data.batch_size`` / ``nproc`` → the micro-batch, the micro-batches per replica
  (global batch ÷ (dp · micro-batch)) and dp (``nproc`` ÷ (tp · pp)), up to the cluster's GPUs.
* ``attention.backend = sdpa`` (a flash-style fused kernel) → ``Layout.attention = "flash"``: no s × s score
  traffic. labkit's own plain-PyTorch FlashAttention and ``torch.compile`` are *not modelled* (the model has
  no term for a slow reference kernel, nor for the fusion and Python overhead a compiler removes).

**Accepting.** :func:`~labkit.tuning.flowchart.accept` needs a loss, and the model has none (nor noise): a
change is kept when its modelled throughput (tokens/s) is at least ``Thresholds.min_speedup`` times the
current one — ``accept``'s own speed test with zero noise. So a compressor or local SGD that would train a
worse model is *not* caught here: the real loop refuses it on loss, the model cannot.

**The walk.** Classify; try the node's candidates in order; on the first one kept, classify again (the
bottleneck moves); once a node's candidates are spent, go to :func:`~labkit.tuning.flowchart.next_node`
(kernels); stop when that too gives no gain. Each keep is ≥ ``min_speedup`` faster: no cycles. The log is the
flowchart's own :class:`~labkit.tuning.flowchart.Decision` list, which :mod:`labkit.widgets.tuning` draws;
:mod:`labkit.sim.optimize_report` writes it as text and draws where the step's time goes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from labkit.sim.cluster import Cluster
from labkit.sim.compression import wire_ratio
from labkit.sim.scenario import LABEL
from labkit.sim.step import Layout, ModelShape, StepBreakdown, step_time
from labkit.tuning.flowchart import (
    Candidate,
    Decision,
    Measurement,
    Thresholds,
    candidate_actions,
    classify,
    next_node,
)
from labkit.tuning.runner import MEASURE, RECORD_BEST

EXPOSED_TERMS = ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm_exposed")  # the collectives the step waits for
BACKENDS = {"naive": "naive", "sdpa": "flash"}  # attention.backend → the model's Layout.attention
NOT_MODELLED = {
    "model.n_embd": "not judged: the step model counts how well each GEMM fills the tiles (labkit.sim.gemm), but a "
                    "new width is a new model (its loss and FLOPs change), not a faster step of this one",
    "run.compile": "not modelled: the step model has no term for the kernel fusion and Python overhead torch.compile "
                   "removes",
    "attention.backend": "not modelled: the model's flash attention is a fused kernel's; labkit's plain-PyTorch "
                         "FlashAttention is written to be read, and its speed is not the model's",
}


class NotModelled(ValueError):
    """A candidate the step model cannot judge; the message says why (it becomes the decision's reason)."""


@dataclass(frozen=True)
class Point:
    """One configuration: the flowchart's dotted settings, what they mean to the model, and its prediction."""
    settings: dict
    layout: Layout
    precision: str
    step: StepBreakdown
    measurement: Measurement


@dataclass
class ModelledWalk:
    """What the walk found: the start, the best point, the flowchart's decision log, why it stopped."""
    shape: ModelShape
    cluster: Cluster
    start: Point
    best: Point
    decisions: list = field(default_factory=list)
    stopped_because: str = ""
    thresholds: Thresholds = field(default_factory=Thresholds)
    label: str = LABEL

    @property
    def speedup(self) -> float:
        return self.best.measurement.tokens_per_s / self.start.measurement.tokens_per_s


# ---------------------------------------------------------------- measuring, in the model

def comm_shares(s: StepBreakdown) -> tuple[float, float]:
    """(in flight, exposed) communication shares of the modelled step (see the module docstring)."""
    exposed = sum(getattr(s, name) for name in EXPOSED_TERMS)
    return (exposed + s.dp_comm_hidden) / s.total, exposed / s.total


def measurement(shape: ModelShape, layout: Layout, s: StepBreakdown, settings: dict) -> Measurement:
    """The flowchart's :class:`Measurement` of a modelled step: tokens/s, MFU, both shares; no loss."""
    in_flight, exposed = comm_shares(s)
    return Measurement(tokens_per_s=layout.global_batch * shape.seq / s.total, mfu=s.mfu, comm_frac=in_flight,
                       loss=None, comm_exposed_frac=exposed, overrides=dict(settings))


def compression_ratio(name: str, shape: ModelShape, dp: int, precision: str) -> float:
    """``Layout.grad_compression`` for compressor ``name`` (:func:`labkit.sim.compression.wire_ratio`); NotModelled
    when there is no rule for it, or when it would send more bytes than no compression (not a compression)."""
    ratio = wire_ratio(name, shape, dp, precision)
    if ratio is None:
        raise NotModelled(f"not modelled: no wire-byte ratio for compressor {name!r}")
    if ratio < 1:
        raise NotModelled(f"rejected (modelled, no step needed): {name} would put {1 / ratio:.2f}× the plain "
                          f"all-reduce's bytes on the wire at {dp} ranks")
    return ratio


# ---------------------------------------------------------------- settings ↔ the model

def start_settings(shape: ModelShape, layout: Layout, precision: str) -> dict:
    """The flowchart's dotted settings that describe ``layout`` (an uncompressed one) at ``precision``."""
    from labkit.parallel.spec import EVERY_STEP

    if layout.grad_compression != 1:
        raise ValueError("start from an uncompressed layout: the walk chooses compressors by name")
    backend = next(name for name, attention in BACKENDS.items() if attention == layout.attention)
    sync = {"comm.sync": EVERY_STEP} if layout.sync_every == 1 else {"comm.sync": "local_sgd",
                                                                     "comm.sync_every": layout.sync_every}
    return {"model.n_embd": shape.hidden, "model.n_head": shape.heads, "precision.mode": precision,
            "nproc": layout.gpus, "data.micro_batch_size": layout.micro_batch, "data.batch_size": layout.global_batch,
            "comm.compression": "none", "attention.backend": backend, **sync}


def model_of(shape: ModelShape, start: Layout, settings: dict) -> tuple[Layout, str]:
    """The layout and precision the settings mean (tp, pp, cp and the rest of ``start`` unchanged)."""
    from labkit.parallel.spec import EVERY_STEP

    nproc, micro, batch = settings["nproc"], settings["data.micro_batch_size"], settings["data.batch_size"]
    replica = start.tp * start.pp * start.cp  # the GPUs of one replica
    if nproc % replica or batch % (nproc // replica * micro):
        raise NotModelled(f"not modelled: {nproc} GPUs, micro-batch {micro} and global batch {batch} make no whole "
                          f"number of replicas and micro-batches at tp {start.tp} × pp {start.pp}"
                          + (f" × cp {start.cp}" if start.cp > 1 else ""))
    dp, precision = nproc // replica, settings["precision.mode"]
    sync_every = 1 if settings["comm.sync"] == EVERY_STEP else settings["comm.sync_every"]
    try:
        layout = dataclasses.replace(
            start, dp=dp, micro_batch=micro, micro_batches=batch // (dp * micro), sync_every=sync_every,
            grad_compression=compression_ratio(settings["comm.compression"], shape, dp, precision),
            attention=BACKENDS[settings["attention.backend"]])
    except ValueError as problem:  # a combination the trainer refuses too (local SGD with a split model)
        raise NotModelled(f"not modelled: {problem}") from None
    return layout, precision


def evaluate(shape: ModelShape, start: Layout, c: Cluster, settings: dict) -> Point:
    """The model's "measurement" of ``settings``; NotModelled when it cannot make one."""
    layout, precision = model_of(shape, start, settings)
    try:
        s = step_time(shape, layout, c, precision)
    except ValueError as problem:  # e.g. more GPUs than the cluster, or a precision without a peak
        raise NotModelled(f"not modelled: {problem}") from None
    return Point(dict(settings), layout, precision, s, measurement(shape, layout, s, settings))


def why_not_modelled(candidate: Candidate) -> str | None:
    """The reason the model cannot judge ``candidate`` (or the flowchart marked it unavailable); None if it can."""
    if not candidate.available:
        return f"skipped, not available: {candidate.unavailable_reason}"
    key, value = next(iter(candidate.overrides.items()))
    if key == "attention.backend" and value in BACKENDS:
        return None
    return f"skipped, {NOT_MODELLED[key]}" if key in NOT_MODELLED else None


# ---------------------------------------------------------------- the walk

def keep(current: Point, trial: Point, t: Thresholds) -> tuple[bool, str]:
    """``accept``'s speed test with no noise and no loss: at least ``t.min_speedup`` more tokens/s, and fits."""
    if not trial.step.fits:
        return False, (f"rejected (modelled): {trial.step.memory_total / 1e9:.1f} GB per GPU does not fit in "
                       f"{trial.step.gpu_memory / 1e9:.0f} GB")
    before, after = current.measurement.tokens_per_s, trial.measurement.tokens_per_s
    rate = f"{before:,.0f} → {after:,.0f} tokens/s ({after / before:.3f}×)"
    if after < t.min_speedup * before:
        return False, f"rejected (modelled): {rate}, below the {t.min_speedup:g}× needed to count as faster"
    return True, f"kept (modelled): {rate}"


def _try(shape, start, c, node, candidate, current, t, log) -> Point | None:
    """Try one candidate on the current point; log the decision; the trial point if kept."""
    skip = why_not_modelled(candidate)
    if skip:
        log(node, candidate, current, None, False, skip)
        return None
    try:
        trial = evaluate(shape, start, c, {**current.settings, **candidate.overrides})
    except NotModelled as why:
        log(node, candidate, current, None, False, str(why))
        return None
    kept, reason = keep(current, trial, t)
    log(node, candidate, current, trial, kept, reason)
    return trial if kept else None


def optimize(shape: ModelShape, layout: Layout, c: Cluster, precision: str = "fp32",
             thresholds: Thresholds | None = None, max_trials: int = 100) -> ModelledWalk:
    """Walk the flowchart from ``layout`` at ``precision`` on cluster ``c``, every number from the step model."""
    t = thresholds or Thresholds()
    t.validate()
    current = evaluate(shape, layout, c, start_settings(shape, layout, precision))
    if not current.step.fits:
        raise ValueError(f"the starting layout does not fit in memory ({current.step.memory_total / 1e9:.1f} GB)")
    walk = ModelledWalk(shape, c, current, current, thresholds=t)

    def log(node, candidate, base: Point, trial: Point | None, kept: bool, reason: str) -> None:
        walk.decisions.append(Decision(len(walk.decisions), node, candidate, base.measurement,
                                       trial.measurement if trial else None, kept, reason))

    trials = 0
    while trials < max_trials:
        node, why = classify(current.measurement, t)
        log(MEASURE, None, current, None, False, f"modelled {current.measurement.tokens_per_s:,.0f} tokens/s "
                                                 f"→ {node}: {why}")
        kept = None
        while node is not None and kept is None:
            for candidate in candidate_actions(node, current.settings, max_nproc=c.gpus):
                trials += 1
                kept = _try(shape, layout, c, node, candidate, current, t, log)
                if kept is not None:
                    break
            if kept is None:
                node = next_node(node)
        if kept is None:
            walk.stopped_because = "no branch of the flowchart gives a modelled gain"
            break
        current = walk.best = kept
    else:
        walk.stopped_because = f"trial budget spent ({max_trials})"
    changed = {k: v for k, v in current.settings.items() if walk.start.settings.get(k) != v}
    log(RECORD_BEST, None, current, None, False, f"stopped: {walk.stopped_because}; best keeps "
        + (", ".join(f"{k}={v}" for k, v in changed.items()) or "nothing (the start was best)"))
    return walk
