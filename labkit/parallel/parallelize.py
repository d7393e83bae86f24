"""Where the model is split across the rank grid, in one place (after torchtitan's ``parallelize.py``).

Every rank builds the *full* model from the run's seed, so every split starts from the weights a
single process would train. Then, in this order:

1. **tensor parallelism** over the ``tp`` axis (``parallel.tp``): each layer's matrices split across
   the tp ranks — labkit's own layers (:mod:`labkit.parallel.tensor`) or torch's DTensor
   ``parallelize_module`` (:mod:`labkit.parallel.tensor_dtensor`);
2. **pipeline parallelism** over the ``pp`` axis (``parallel.pp``): each pp rank keeps its stage's
   layers (:mod:`labkit.parallel.pipeline`);
3. **data parallelism** over the ``dp`` axis: the strategy wraps what is left (``train.build_trainer``).

Splitting the model changes two things the rest of the loop relies on, and this module owns both:

* **the global gradient norm** (for clipping): a tp-sharded parameter contributes its slice from each
  tp rank, a replicated one (layer norms, position embeddings) must be counted once, not tp times,
  and each pipeline stage holds different layers. :func:`norm_shares` gives each local parameter the
  share of its squared norm this rank adds to one world-wide sum (:func:`clip_grad_norm_shared`);
* **which data-parallel strategies combine with which split**: each strategy declares it
  (``model_parallel`` in :mod:`labkit.parallel.spec`), and
  :func:`layout_problems` says so before any worker starts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.metrics.timers import CommTimer

TP_IMPLS = ("labkit", "dtensor")
PP_IMPLS = ("labkit", "torch")


def apply_pipeline(model: nn.Module, grid) -> nn.Module:
    """This rank's stage of ``model`` over the grid's pp axis (:class:`labkit.parallel.pipeline.GPTStage`);
    pp = 1 leaves it whole."""
    if grid.size("pp") == 1:
        return model
    from labkit.parallel.pipeline import GPTStage

    return GPTStage.from_gpt(model, grid.coord("pp"), grid.size("pp"))


def pipeline_neighbours(grid) -> tuple:
    """Global ranks of the previous and the next stage of this rank's pipeline (None at the ends)."""
    ranks, stage = grid.ranks("pp"), grid.coord("pp")
    return ranks[stage - 1] if stage > 0 else None, ranks[stage + 1] if stage < len(ranks) - 1 else None


def build_pipeline_schedule(stage_module: nn.Module, cfg, grid, timer: CommTimer, autocast, strategy, module):
    """The schedule that runs a step's micro-batches through the pipeline (``parallel.pp.impl`` and
    ``.schedule``), or None for a whole model. Every rank calls it: the tied-embedding groups are made here.

    The tied embedding's two copies are summed by one of the ``strategy``'s gradient hooks: after its
    replicas' gradients are final and before a ZeRO strategy shards them (``Strategy.sync_gradients``)."""
    if grid.size("pp") == 1:
        return None
    from labkit.parallel.pipeline import PipelineSchedule, allreduce_tied_embedding, tied_embedding_group

    pipelines = sorted({tuple(grid.dims.axis_ranks(r, "pp")) for r in range(grid.dims.world_size)})
    tied = tied_embedding_group([list(p) for p in pipelines])
    strategy.gradient_hooks.append(lambda: allreduce_tied_embedding(stage_module, tied, timer))
    ranks, stage, neighbours = grid.ranks("pp"), grid.coord("pp"), pipeline_neighbours(grid)
    no_sync = lambda: strategy.no_sync(module)  # noqa: E731 - a stage's backwards but its last stay local
    kwargs = dict(schedule=cfg.parallel.pp.schedule, timer=timer, pp_group=grid.group("pp"), autocast=autocast)
    if cfg.parallel.pp.impl == "torch":
        from labkit.parallel.pipeline_torch import TorchPipelineSchedule

        return TorchPipelineSchedule(stage_module, stage, len(ranks), *neighbours, **kwargs)
    return PipelineSchedule(stage_module, stage, len(ranks), *neighbours, no_sync=no_sync, **kwargs)


def apply_tensor_parallel(model: nn.Module, cfg, grid, timer: CommTimer) -> nn.Module:
    """Split ``model`` over the grid's tp axis (in place) with ``parallel.tp.impl``; tp = 1 leaves it whole."""
    tp = cfg.parallel.tp
    if grid.size("tp") == 1:
        return model
    if tp.impl == "dtensor":
        from labkit.parallel.tensor_dtensor import parallelize_gpt_dtensor

        return parallelize_gpt_dtensor(model, grid.submesh("tp"), sequence_parallel=tp.sequence_parallel)
    from labkit.parallel.tensor import parallelize_gpt

    if tp.sequence_parallel:
        return parallelize_gpt(model, grid.group("tp"), timer, sequence_parallel=True)
    return parallelize_gpt(model, grid.group("tp"), timer)


def tensor_parallel_gradient_hooks(model: nn.Module, cfg, grid, timer: CommTimer) -> list:
    """What a tensor-parallel model's gradients need after backward, before clipping (a strategy's
    ``gradient_hooks``): sequence parallelism leaves the norms' and position embedding's gradients partial on
    each tp rank, to be summed over tp (labkit: one flat all-reduce; DTensor: each ``Partial`` placement).

    Call it before the strategy wraps the model: FSDP2 replaces the parameters (names stay, flags go), so
    the flagged parameters are remembered by name and flagged again when the hook runs."""
    if grid.size("tp") == 1 or not cfg.parallel.tp.sequence_parallel:
        return []
    if cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tensor_dtensor import reduce_partial_grads

        return [lambda: reduce_partial_grads(model)]
    from labkit.parallel.sequence import mark_sequence_parallel, sync_sequence_parallel_grads

    names = [name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]

    def sum_partial_gradients():
        params = dict(model.named_parameters())
        mark_sequence_parallel(*(params[name] for name in names))
        sync_sequence_parallel_grads(model, grid.group("tp"), timer)
    return [sum_partial_gradients]


def forward_backward_context(cfg, grid):
    """A context factory around each forward and backward: DTensor's vocabulary-parallel loss needs
    ``loss_parallel()`` around both; every other layout needs nothing."""
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tensor_dtensor import loss_parallel_context

        return loss_parallel_context
    from contextlib import nullcontext

    return nullcontext


def tp_sharded_params(model: nn.Module) -> set[int]:
    """ids of the parameters labkit's tensor-parallel layers hold a *slice* of (the rest is replicated)."""
    from labkit.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        VocabParallelHead)

    sharded: set[int] = set()
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding, VocabParallelHead)):
            sharded.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):  # its bias is added after the sum: replicated
            sharded.add(id(module.weight))
    return sharded


def second_copies(model: nn.Module) -> set[int]:
    """ids of parameters that are a copy of one held elsewhere: the last pipeline stage's tied output layer
    (the first stage holds the embedding it copies)."""
    if getattr(model, "n_stages", 1) > 1 and model.is_last:
        return {id(model.lm_head.weight)}
    return set()


def norm_shares(model: nn.Module, grid, dp_sharded: bool = False) -> list[tuple]:
    """(parameter, share): summing share · ‖local gradient‖² over every rank of the world gives the
    squared global norm.

    A tp-sharded parameter's slices add up over the tp ranks (share 1); a replicated one is held by all
    tp ranks alike (share 1/tp), and by every dp replica alike unless the strategy shards it over dp
    (``dp_sharded``: ZeRO, FSDP), share 1/dp more. Each pipeline stage holds its own layers (they add up
    over the pp ranks), but a second copy of a tied embedding has share 0 (:func:`second_copies`).
    """
    from torch.distributed.tensor import DTensor

    tp, dp = grid.size("tp"), grid.size("dp")
    sharded, skip = tp_sharded_params(model), second_copies(model)
    shares = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in skip:  # counted where the original lives, but clipped here all the same
            shares.append((p, 0.0))
            continue
        if isinstance(p, DTensor):  # a DTensor knows its placements: sharded on a mesh axis means sliced
            names = p.device_mesh.mesh_dim_names or ()
            sliced = {name for name, place in zip(names, p.placements)  # Shard, and FSDP's _StridedShard
                      if not (place.is_replicate() or place.is_partial())}
            on_tp, on_dp = "tp" in sliced or id(p) in sharded, "dp" in sliced
        else:
            on_tp, on_dp = id(p) in sharded, dp_sharded
        shares.append((p, (1.0 if on_tp else 1.0 / tp) * (1.0 if on_dp else 1.0 / dp)))
    return shares


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm_shared(shares: list[tuple], max_norm: float, group=None) -> float:
    """The global gradient norm from every rank's shares (one all-reduce of one number over ``group``,
    the world by default), and every gradient scaled by min(1, max_norm / (norm + 1e-6)), as
    ``torch.nn.utils.clip_grad_norm_`` does."""
    device = shares[0][0].device if shares else torch.device("cpu")
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    for p, share in shares:
        if p.grad is not None:
            squares += share * _local(p.grad).double().pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p, _ in shares:
            if p.grad is not None:
                _local(p.grad).mul_(coef)
    return norm


def is_model_parallel(grid) -> bool:
    return grid.size("tp") * grid.size("pp") > 1


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



def gather_tensor_parallel_state(state: dict, model: nn.Module, group) -> dict:
    """The whole model's weights from each tp rank's ``state`` (labkit's layers): every slice gathered over
    the tp ``group`` and put back in place, so a split run saves what a single process would have saved.
    A collective: every tp rank calls it. Entries a rank does not hold (an empty state) stay absent."""
    from labkit.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                                        VocabParallelEmbedding, VocabParallelHead)

    if not state:
        return state
    size = dist.get_world_size(group)
    qkv = {f"{name}.qkv" for name, m in model.named_modules() if isinstance(m, TensorParallelAttention)}
    rules = {}  # state key → how its slices go back together
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding, VocabParallelHead)):
            rules[f"{name}.weight"] = "qkv" if name in qkv else 0
            if getattr(m, "bias", None) is not None:
                rules[f"{name}.bias"] = "qkv" if name in qkv else 0
        elif isinstance(m, RowParallelLinear):
            rules[f"{name}.weight"] = 1
    full = dict(state)
    for key, rule in rules.items():
        local = state[key].contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        if rule == "qkv":  # each rank holds [q_r | k_r | v_r]: regroup as [q | k | v]
            parts = [torch.cat([p.chunk(3, dim=0)[i] for p in parts], dim=0) for i in range(3)]
            full[key] = torch.cat(parts, dim=0)
        else:
            full[key] = torch.cat(parts, dim=rule)
    return full


def whole_model_state(state: dict, model: nn.Module, cfg, grid) -> dict:
    """A split model's ``full_state_dict`` made whole, named as the GPT names it (collectives over tp and pp;
    the identity for a whole model)."""
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "labkit":
        state = gather_tensor_parallel_state(state, model, grid.group("tp"))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tensor_dtensor import fused_qkv_state

        state = fused_qkv_state(state)  # the DTensor path splits q, k and v: joined as the GPT holds them
    if grid.size("pp") > 1:
        state = {model.gpt_name(k): v for k, v in state.items()}
        stages = [None] * grid.size("pp")
        dist.all_gather_object(stages, state, group=grid.group("pp"))
        state = {k: v for stage in stages for k, v in stage.items()}  # wte from the first, lm_head from the last
    return state
