"""What a model-parallel layout needs, said before any worker starts (``labkit.validation`` collects it).

The tp and pp degrees must fit the model (whole attention heads and vocabulary rows per tp rank, a
layer per pipeline stage), and the rest of the config must combine with a split model: each
data-parallel strategy declares which implementations of each axis it runs beside
(``model_parallel`` in :mod:`labkit.parallel.spec`); the CAP lab and local SGD need whole replicas.
"""
from __future__ import annotations


def vocab_size_of(cfg) -> int | None:
    """The model's vocabulary: ``model.vocab_size``, or the dataset's alphabet (None if unknown yet)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer == "byte":
        return 256
    from labkit.data.corpora import load_metadata

    try:
        meta = load_metadata(cfg.data.dataset)
    except Exception:  # a missing dataset is reported by the data checks
        return None
    alphabet = (meta or {}).get("alphabet")
    return len(alphabet) if alphabet else None


def layout_problems(cfg, world: int) -> list[str]:
    """Said before any worker starts: what the tp and pp degrees need of the model, and what they combine with."""
    p, m, found = cfg.parallel, cfg.model, []
    tp, pp = p.tp.degree, p.pp.degree
    if tp > 1:
        if m.n_head > 0 and m.n_head % tp:
            found.append(f"parallel.tp.degree={tp}: model.n_head={m.n_head} is not divisible by it; tensor "
                         f"parallelism gives each rank whole attention heads (use a tp that divides {m.n_head})")
        vocab = vocab_size_of(cfg)
        if vocab and vocab % tp:
            found.append(f"parallel.tp.degree={tp}: the vocabulary ({vocab} tokens) is not divisible by it; the "
                         f"embedding and the output layer are split by vocabulary (set model.vocab_size to a "
                         f"multiple of {tp}, at least {vocab})")
        if p.tp.sequence_parallel and m.block_size % tp:
            found.append(f"parallel.tp.sequence_parallel: model.block_size={m.block_size} is not divisible by "
                         f"parallel.tp.degree={tp}; sequence parallelism splits each sequence across the tp ranks")
    elif p.tp.sequence_parallel:
        found.append("parallel.tp.sequence_parallel needs parallel.tp.degree > 1 (it splits activations across "
                     "the tensor-parallel ranks)")
    if pp > 1 and p.tp.sequence_parallel:
        found.append("parallel.tp.sequence_parallel with parallel.pp.degree > 1: a pipeline's messages are "
                     "whole-sequence activations in this version of labkit; turn one of them off")
    if pp > 1 and tp > 1 and p.tp.impl == "dtensor":
        found.append("parallel.tp.impl=dtensor with parallel.pp.degree > 1: a pipeline stage is split by labkit's "
                     "own tensor-parallel layers; use parallel.tp.impl=labkit")
    if p.pp.schedule == "interleaved_1f1b":
        found.append("parallel.pp.schedule=interleaved_1f1b: torch's ScheduleInterleaved1F1B runs on gloo "
                     "(labkit.parallel.pipeline_torch, tested in tests/parallel/test_pipeline.py), but the trainer "
                     "holds one stage per rank in this version of labkit; use gpipe or 1f1b")
    if pp > 1 and 0 < m.n_layer < pp:
        found.append(f"parallel.pp.degree={pp}: model.n_layer={m.n_layer} cannot be cut into {pp} stages; every "
                     f"stage needs at least one layer (use pp <= {m.n_layer})")
    if tp * pp > 1:
        found += _combination_problems(cfg, tp, pp)
    return found


def _combination_problems(cfg, tp: int, pp: int) -> list[str]:
    from labkit.parallel.spec import EVERY_STEP, STRATEGIES

    p, found = cfg.parallel, []
    layout = " × ".join(f"{name}={deg}" for name, deg in (("tp", tp), ("pp", pp)) if deg > 1)
    if cfg.comm.consistency is not None:
        found.append(f"comm.consistency={cfg.comm.consistency}: the CAP lab runs whole replicas; set "
                     f"parallel.tp.degree=1 and parallel.pp.degree=1 (this layout: {layout})")
    if cfg.comm.sync != EVERY_STEP:
        found.append(f"comm.sync={cfg.comm.sync}: replicas that drift apart between synchronisations are whole "
                     f"models; with a split model ({layout}) use comm.sync={EVERY_STEP}")
    strategy = STRATEGIES.get(p.dp.strategy) if p.dp.strategy in STRATEGIES else None
    for axis, degree, impl in (("tp", tp, p.tp.impl), ("pp", pp, p.pp.impl)):
        if strategy is None or degree == 1 or impl in strategy.model_parallel[axis]:
            continue
        takers = " or ".join(n for n, s in STRATEGIES.items() if impl in s.model_parallel[axis]) or "none yet"
        why = strategy.model_parallel_note or "it is not written for a split model"
        found.append(f"parallel.dp.strategy={p.dp.strategy} does not combine with parallel.{axis}.impl={impl}: "
                     f"{why}; use parallel.dp.strategy={takers}")
    if cfg.precision.mode in ("fp16", "fp8"):
        found.append(f"precision.mode={cfg.precision.mode} is not available with a split model ({layout}): fp16's "
                     "loss scaler would have to agree on overflows across the model-parallel ranks and fp8 swaps "
                     "the linear layers that tensor parallelism splits; use precision.mode=bf16 or fp32")
    if cfg.run.compile != "off":
        found.append(f"run.compile={cfg.run.compile} is not verified on a split model ({layout}) in this version "
                     "of labkit; set run.compile=off")
    return found
