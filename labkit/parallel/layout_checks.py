"""What a model-parallel layout needs, said before any worker starts (``labkit.validation`` collects it).

The tp and pp degrees must fit the model (whole attention heads and vocabulary rows per tp rank, a
layer per pipeline stage), and the rest of the config must combine with a split model: each
data-parallel strategy declares only the (axis, implementation) pairs it refuses, with the reason (``refuses`` in
:mod:`labkit.parallel.spec`), and runs beside every other; ``parallel.dp.strategy=auto`` takes the first that refuses
none of the layout's (:func:`auto_strategy`). Sync strategies (``comm.sync``: local SGD) declare theirs the same way;
the CAP lab needs whole replicas.
"""
from __future__ import annotations

from labkit.parallel.mesh import context_degree, expert_degree


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
                     "(labkit.parallel.pp.torch_pipelining, tested in tests/parallel/test_pipeline.py), but the "
                     "trainer holds one stage per rank in this version of labkit; use gpipe or 1f1b")
    if pp > 1 and p.pp.impl == "torch" and p.pp.schedule == "1f1b":
        found += _torch_1f1b_problems(cfg, world)
    if pp > 1 and 0 < m.n_layer < pp:
        found.append(f"parallel.pp.degree={pp}: model.n_layer={m.n_layer} cannot be cut into {pp} stages; every "
                     f"stage needs at least one layer (use pp <= {m.n_layer})")
    cp = context_degree(cfg)
    if cp > 1:
        found += context_problems(cfg)
    ep = expert_degree(cfg)
    if tp * pp * cp * ep > 1:
        found += _combination_problems(cfg, tp, pp, cp, ep)
    return found


def context_problems(cfg) -> list[str]:
    """What ``parallel.cp`` needs of the model and of the rest of the layout (cp > 1)."""
    from labkit.parallel.cp import NATIVE
    from labkit.parallel.cp.sharding import n_chunks
    from labkit.parallel.cp.ulysses import heads_problem

    p, m, found = cfg.parallel, cfg.model, []
    cp, impl, layout = p.cp.degree, p.cp.impl, p.cp.layout
    if impl == NATIVE:
        found.append(f"parallel.cp.impl={NATIVE}: torch's context_parallel needs CUDA with the flash or efficient "
                     "SDPA backend (it does not handle the math backend, so not on a CPU), and labkit's trainer "
                     "does not run it in this version; use parallel.cp.impl=ring (labkit's ring attention, checked "
                     "against one rank's attention in tests/parallel/test_context_parallel.py)")
    chunks = n_chunks(cp, layout)
    if m.block_size % chunks:
        found.append(f"parallel.cp.degree={cp} with parallel.cp.layout={layout} cuts each sequence into {chunks} "
                     f"equal chunks, and model.block_size={m.block_size} does not divide by {chunks}; use a block_size "
                     f"that is a multiple of {chunks}")
    heads = m.n_head // p.tp.degree if p.tp.degree > 1 and m.n_head % p.tp.degree == 0 else m.n_head
    if impl == "ulysses" and heads > 0 and heads_problem(heads, cp):
        held = f" (the {heads} heads each tp rank holds)" if p.tp.degree > 1 else ""
        found.append(f"parallel.cp.impl=ulysses{held}: {heads_problem(heads, cp)}")
    if p.tp.degree > 1 and p.tp.sequence_parallel:
        found.append("parallel.tp.sequence_parallel with parallel.cp.degree > 1: both split the sequence, and this "
                     "version of labkit splits it once; turn one of them off")
    if p.tp.degree > 1 and p.tp.impl == "dtensor":
        found.append("parallel.tp.impl=dtensor with parallel.cp.degree > 1: context-parallel attention is wired into "
                     "labkit's own tensor-parallel layers; use parallel.tp.impl=labkit")
    if cfg.attention.backend not in ("auto", "sdpa"):
        found.append(f"attention.backend={cfg.attention.backend} with parallel.cp.degree={cp}: under context "
                     f"parallelism attention is parallel.cp.impl={impl}'s, computed block by block (the backend "
                     "would not run); leave attention.backend at sdpa")
    if cfg.precision.mode == "bf16":
        found.append(f"precision.mode={cfg.precision.mode} with parallel.cp.degree={cp}: labkit's context-parallel "
                     "attention merges its blocks in the inputs' precision and is checked in fp32 and fp64 only in "
                     "this version; use precision.mode=fp32")
    return found


def _torch_1f1b_problems(cfg, world: int) -> list[str]:
    """torch's Schedule1F1B refuses fewer micro-batches per step than stages (labkit's 1F1B and GPipe run them)."""
    from labkit.parallel.mesh import ParallelDims

    d, pp = cfg.data, cfg.parallel.pp.degree
    dp = ParallelDims.from_config(cfg, world).dp
    per_step = dp * d.micro_batch_size
    if per_step <= 0 or d.batch_size <= 0 or d.batch_size % per_step:
        return []  # the batch split is reported by mesh.grid_problems
    m = d.batch_size // per_step
    if m >= pp:
        return []
    return [f"parallel.pp.impl=torch with parallel.pp.schedule=1f1b needs at least as many micro-batches per step "
            f"as stages: data.batch_size={d.batch_size} / (dp={dp} × data.micro_batch_size={d.micro_batch_size}) "
            f"= {m} micro-batch(es) < parallel.pp.degree={pp} (torch's Schedule1F1B refuses m < p); set "
            f"data.batch_size={pp * per_step} or more, or use parallel.pp.schedule=gpipe or parallel.pp.impl=labkit"]


def split_axes(cfg) -> list[tuple[str, int, str]]:
    """The layout's model-parallel axes (:data:`labkit.parallel.spec.IMPLS`: tp, pp, cp) of degree > 1:
    (axis, degree, implementation)."""
    from labkit.parallel.spec import IMPLS

    sections = [(axis, getattr(cfg.parallel, axis, None)) for axis in IMPLS]  # a config older than an axis: none
    return [(axis, s.degree, s.impl) for axis, s in sections if s is not None and s.degree > 1]


def uncombined(strategy, cfg) -> list[tuple[str, str]]:
    """The split axes of ``cfg`` (axis, implementation) that ``strategy`` refuses (its ``refuses``)."""
    return [(axis, impl) for axis, _, impl in split_axes(cfg) if (axis, impl) in strategy.refuses]


def takers(axis: str, impl: str) -> list[str]:
    """The registered strategies that do not refuse ``impl`` of ``axis``, in the registry's order."""
    from labkit.parallel.spec import STRATEGIES

    return [name for name, s in STRATEGIES.items() if (axis, impl) not in s.refuses]


def auto_strategy(cfg) -> tuple[str | None, str]:
    """``parallel.dp.strategy=auto``'s choice and why: the first registered strategy (the registry's order) that
    runs beside every split axis and, with ``comm.compression``, compresses its buckets; None if none runs."""
    from labkit.parallel.spec import STRATEGIES

    fits = [s for s in STRATEGIES.values() if not uncombined(s, cfg)]
    if cfg.comm.compression != "none":
        fits = [s for s in fits if s.compresses] or fits
    beside = " and ".join(f"{axis}={degree} (parallel.{axis}.impl={impl})" for axis, degree, impl in split_axes(cfg))
    if not fits:
        return None, f"no registered strategy runs beside {beside}"
    return fits[0].name, _why_chosen(fits[0], next(iter(STRATEGIES.values())), beside, cfg)


def _why_chosen(chosen, first, beside: str, cfg) -> str:
    why = (f"the first strategy in labkit.parallel.STRATEGIES that runs beside {beside}" if beside
           else "the first strategy in labkit.parallel.STRATEGIES (no model-parallel axis to combine with)")
    if cfg.comm.compression != "none" and chosen.compresses:
        why += f" and compresses its buckets (comm.compression={cfg.comm.compression})"
    if chosen is not first and uncombined(first, cfg):
        axis, impl = uncombined(first, cfg)[0]
        why += f"; {first.name} does not run beside parallel.{axis}.impl={impl}: {first.refuses[axis, impl]}"
    return why


def _combination_problems(cfg, tp: int, pp: int, cp: int = 1, ep: int = 1) -> list[str]:
    from labkit.parallel.spec import AUTO, EVERY_STEP, STRATEGIES, SYNC_STRATEGIES

    p, found = cfg.parallel, []
    degrees = (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep))
    layout = " × ".join(f"{name}={deg}" for name, deg in degrees if deg > 1)
    if cfg.comm.consistency is not None:
        split = " and ".join(f"parallel.{name}.degree=1" for name, deg in degrees
                             if deg > 1 or name in ("tp", "pp"))
        found.append(f"comm.consistency={cfg.comm.consistency}: the CAP lab runs whole replicas; set "
                     f"{split} (this layout: {layout})")
    sync = SYNC_STRATEGIES.get(cfg.comm.sync) if cfg.comm.sync in SYNC_STRATEGIES else None
    for axis, impl in uncombined(sync, cfg)[:1] if sync is not None else []:  # one line: the fix is the same
        found.append(f"comm.sync={cfg.comm.sync}: {sync.refuses[axis, impl]}; with a split model ({layout}) use "
                     f"comm.sync={EVERY_STEP}")
    if p.dp.strategy == AUTO:  # still auto: validate() resolves it first, so nothing runs beside this layout
        found.append(f"parallel.dp.strategy={AUTO}: {auto_strategy(cfg)[1]}")
    strategy = STRATEGIES.get(p.dp.strategy) if p.dp.strategy in STRATEGIES else None
    for axis, impl in uncombined(strategy, cfg) if strategy is not None else []:
        others = " or ".join(takers(axis, impl))
        fix = f"use parallel.dp.strategy={others} (or {AUTO})" if others else "no strategy runs beside it yet"
        found.append(f"parallel.dp.strategy={p.dp.strategy} does not combine with parallel.{axis}.impl={impl}: "
                     f"{strategy.refuses[axis, impl]}; {fix}")
    if cfg.precision.mode in ("fp16", "fp8"):
        found.append(f"precision.mode={cfg.precision.mode} is not available with a split model ({layout}): fp16's "
                     "loss scaler would have to agree on overflows across the model-parallel ranks and fp8 swaps "
                     "the linear layers that tensor parallelism splits; use precision.mode=bf16 or fp32")
    if cfg.run.compile != "off":
        found.append(f"run.compile={cfg.run.compile} is not verified on a split model ({layout}) in this version "
                     "of labkit; set run.compile=off")
    return found
