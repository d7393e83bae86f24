"""Where the model is split across the rank grid, in one place (after torchtitan's ``parallelize.py``).

Every rank builds the *whole* model on the meta device (shapes, no memory) and cuts it there; a part
becomes real only once it is this rank's (:func:`part_maker`, :mod:`labkit.model.init`): each value comes
from the run's seed and the parameter's name in the GPT, so every split starts from the weights a single
process would train, and no rank ever holds more than its part plus one unit. In this order
(:func:`parallelize`, which ``train.build_trainer`` calls):

1. **pipeline parallelism** over the ``pp`` axis (``parallel.pp``): each pp rank keeps its stage's
   layers (:mod:`labkit.parallel.pp.pipeline`), and a schedule runs the step's micro-batches through them;
2. **tensor parallelism** over the ``tp`` axis (``parallel.tp``): the stage's matrices split across the
   tp ranks — labkit's own layers (:mod:`labkit.parallel.tp.layers`, :mod:`labkit.parallel.tp.model`)
   or torch's DTensor ``parallelize_module`` (:mod:`labkit.parallel.tp.dtensor`); then **expert parallelism** over
   the ``ep`` axis (``parallel.ep``): each rank keeps its E/ep of every MoE layer's experts (whole on every tp rank),
   and tokens reach them by all-to-all (:mod:`labkit.parallel.ep`);
3. **context parallelism** over the ``cp`` axis (``parallel.cp``): every attention layer attends over the whole
   sequence from this rank's chunks of it, and each token keeps the position of its place in the whole
   (:mod:`labkit.parallel.cp.model`; the trainer cuts each micro-batch with :func:`sequence_part`); then every
   dropout draws from a generator kept for its region (:func:`apply_rng_tracker`, :mod:`labkit.parallel.rng`);
   activation checkpointing is already there, inside each block (``model.recompute``);
4. **compilation** (``run.compile=on``, :func:`apply_compile`): after the split and the checkpointing, before
   the data-parallel wrap — torchtitan's order, TP → activation checkpointing → compile → FSDP;
5. **data parallelism** over the ``dp`` axis — dp × cp with context parallelism, whose ranks hold the same
   parameters (``labkit.parallel.mesh.GRADIENT_AXIS``): the strategy wraps what is left. What is still on
   the meta device is made real before the wrap — or after it, for a strategy that shards the model itself
   (FSDP2, ``Strategy.shards_meta``): then each rank draws only its shards.

Splitting the model changes what the rest of the loop relies on, and this module owns it: what the
gradients need after backward (:func:`tensor_parallel_gradient_hooks`, the tied embedding's sum in
:func:`build_pipeline_schedule`), the whole model gathered back for saving (:func:`whole_model_state`), and

* **the global gradient norm** (for clipping): a tp-sharded parameter contributes its slice from each
  tp rank, a replicated one (layer norms, position embeddings) must be counted once, not tp times,
  and each pipeline stage holds different layers. :func:`norm_shares` gives each local parameter the
  share of its squared norm this rank adds to one world-wide sum (:func:`clip_grad_norm_shared`);
* **which data-parallel strategies combine with which split**: each strategy declares what it refuses
  (``refuses`` in :mod:`labkit.parallel.spec`), and
  :func:`labkit.parallel.layout_checks.layout_problems` says so before any worker starts.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from labkit.comm import control
from labkit.comm.axes import AxisGroup
from labkit.compile import compile_in_place
from labkit.model.init import materialise
from labkit.parallel.ep import apply_expert_parallel, expert_gradient_hook, gather_experts, is_expert
from labkit.parallel.mesh import EXPERT_GRADIENT_AXIS, GRADIENT_AXIS


def parallelize(model: nn.Module, cfg, env) -> tuple[nn.Module, nn.Module, object]:
    """Split the meta-device ``model`` over ``env``'s rank grid in the module docstring's order, make this rank's
    part real and wrap it in the data-parallel strategy; returns (the bare model, the wrapped module the loop calls,
    the strategy). The split layers hold their axis's group (``grid.axis_group``): the step counts their traffic
    (:func:`labkit.comm.axes.counting`)."""
    from labkit.parallel import build_strategy

    grid = env.grid
    model = apply_pipeline(model, grid)
    make_real = part_maker(model, cfg.run.seed, env.torch_device)
    model = apply_tensor_parallel(model, cfg, grid, make_real)
    model = apply_expert_parallel(model, grid, make_real)
    model = apply_context_parallel(model, cfg, grid, env.torch_device)
    model = apply_rng_tracker(model, cfg, grid, env.torch_device)
    freeze(model, cfg.model.freeze)  # activation checkpointing is inside each block already (model.recompute)
    model = apply_compile(model, cfg)  # after the split and the checkpointing, before the wrap (its docstring)
    strategy = build_strategy(cfg, env)
    split_hooks = tensor_parallel_gradient_hooks(model, cfg, grid)  # before wrap: FSDP2 swaps params
    split_hooks += [hook for hook in [expert_gradient_hook(model, grid)] if hook is not None]
    if not strategy.shards_meta:
        make_real(model)
    module = strategy.wrap(model)
    make_real(model)  # FSDP2: this rank's shards
    strategy.gradient_hooks += split_hooks
    return model, module, strategy


def freeze(model: nn.Module, prefixes: list[str]) -> None:
    """Parameters whose name starts with one of ``prefixes`` are not trained (``model.freeze``)."""
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            p.requires_grad_(False)


def apply_pipeline(model: nn.Module, grid) -> nn.Module:
    """This rank's stage of ``model`` over the grid's pp axis (:class:`labkit.parallel.pp.pipeline.GPTStage`);
    pp = 1 leaves it whole."""
    if grid.size("pp") == 1:
        return model
    from labkit.parallel.pp.pipeline import GPTStage

    return GPTStage.from_gpt(model, grid.coord("pp"), grid.size("pp"))


def pipeline_neighbours(grid) -> tuple:
    """Global ranks of the previous and the next stage of this rank's pipeline (None at the ends)."""
    ranks, stage = grid.ranks("pp"), grid.coord("pp")
    return ranks[stage - 1] if stage > 0 else None, ranks[stage + 1] if stage < len(ranks) - 1 else None


def build_pipeline_schedule(stage_module: nn.Module, cfg, grid, autocast, strategy, module):
    """The schedule that runs a step's micro-batches through the pipeline (``parallel.pp.impl`` and
    ``.schedule``), or None for a whole model. Every rank calls it: the tied-embedding groups are made here.

    The tied embedding's two copies are summed by one of the ``strategy``'s gradient hooks: after its
    replicas' gradients are final and before a ZeRO strategy shards them (``Strategy.sync_gradients``)."""
    if grid.size("pp") == 1:
        return None
    from labkit.parallel.pp.pipeline import PipelineSchedule, allreduce_tied_embedding, tied_embedding_group

    pipelines = sorted({tuple(grid.dims.axis_ranks(r, "pp")) for r in range(grid.dims.world_size)})
    tied = tied_embedding_group([list(p) for p in pipelines])  # None on a rank that holds no copy
    tied = AxisGroup("pp", tied) if tied is not None else None  # pipeline traffic: counted on the pp axis
    strategy.gradient_hooks.append(lambda: allreduce_tied_embedding(stage_module, tied))
    ranks, stage, neighbours = grid.ranks("pp"), grid.coord("pp"), pipeline_neighbours(grid)
    no_sync = lambda: strategy.no_sync(module)  # noqa: E731 - a stage's backwards but its last stay local
    kwargs = dict(schedule=cfg.parallel.pp.schedule, pp_group=grid.axis_group("pp"), autocast=autocast)
    if cfg.parallel.pp.impl == "torch":
        from labkit.parallel.pp.torch_pipelining import TorchPipelineSchedule

        return TorchPipelineSchedule(stage_module, stage, len(ranks), *neighbours, **kwargs)
    return PipelineSchedule(stage_module, stage, len(ranks), *neighbours, no_sync=no_sync, **kwargs)


def part_maker(model: nn.Module, seed: int, device):
    """``make_real(unit, name)``: make ``unit`` (``model`` itself, or its submodule called ``name``) real on
    ``device``, every parameter from the seed and its name in the whole GPT (:mod:`labkit.model.init`)."""
    gpt_name = getattr(model, "gpt_name", lambda name: name)  # a pipeline stage's blocks.0 may be the GPT's 6

    def make_real(unit: nn.Module, name: str = "") -> None:
        materialise(unit, model.shape.n_layer, seed, device, lambda n: gpt_name(f"{name}.{n}" if name else n))
    return make_real


def apply_tensor_parallel(model: nn.Module, cfg, grid, make_real=None) -> nn.Module:
    """Split ``model`` over the grid's tp axis (in place) with ``parallel.tp.impl``; tp = 1 leaves it whole.
    A model on the meta device is made real a unit at a time as it is split (``make_real``: :func:`part_maker`)."""
    tp = cfg.parallel.tp
    if grid.size("tp") == 1:
        return model
    if tp.impl == "dtensor":
        from labkit.parallel.tp.dtensor import parallelize_gpt_dtensor

        return parallelize_gpt_dtensor(model, grid.submesh("tp"), tp.sequence_parallel, make_real)
    from labkit.parallel.tp.model import parallelize_gpt

    return parallelize_gpt(model, grid.axis_group("tp"), tp.sequence_parallel, make_real)


def apply_context_parallel(model: nn.Module, cfg, grid, device) -> nn.Module:
    """Make ``model`` attend over the grid's cp axis with ``parallel.cp.impl`` (in place); cp = 1 leaves it."""
    if grid.size("cp") == 1:
        return model
    from labkit.parallel.cp.model import apply_context_parallel as apply

    return apply(model, cfg.parallel.cp, grid, device)


def apply_rng_tracker(model: nn.Module, cfg, grid, device) -> nn.Module:
    """Each dropout draws from its region's generator (:mod:`labkit.parallel.rng`): alike over the tp ranks holding
    the same activation, apart over the ranks holding different tokens (sequence- and context-parallel shards)."""
    from labkit.parallel.rng import track_dropouts

    sequence_parallel = grid.size("tp") > 1 and cfg.parallel.tp.sequence_parallel
    track_dropouts(model, cfg.run.seed, grid, sequence_parallel, device)
    return model


def apply_compile(model: nn.Module, cfg) -> nn.Module:
    """``run.compile=on``: compile ``model`` in place (``nn.Module.compile``; it traces at its first call).

    Why here, in torchtitan's order TP → activation checkpointing → compile → FSDP: compile must see the modules
    that will run — the tensor-parallel layers, the blocks that recompute (checkpointing is traced into the
    graph as recomputation, not wrapped around it after) — so it comes after both; and the data-parallel wrap
    comes after compile, so its machinery stays outside the graph: FSDP2's gather and free hooks run eagerly
    around the compiled code (torch keeps them out of tracing), DDP's gradient hooks fire in backward, and the
    wrapper holds the very object compiled. torchtitan compiles each block, labkit the whole model; in place, so
    ``run.compile=verify`` (a callback: it times eager steps first, then compiles) can drop it again.
    (labkit does not yet allow compilation with a split model: :func:`labkit.parallel.layout_checks.layout_problems`.)
    """
    if cfg.run.compile == "on":
        compile_in_place(model)
    return model


def sequence_part(cfg, grid):
    """What the trainer applies to each micro-batch's (B, T) tokens: this rank's chunks under context parallelism,
    all of them otherwise."""
    from labkit.parallel.cp.model import sequence_part as part

    return part(cfg.parallel.cp, grid)


def tensor_parallel_gradient_hooks(model: nn.Module, cfg, grid) -> list:
    """What a tensor-parallel model's gradients need after backward, before clipping (a strategy's
    ``gradient_hooks``): sequence parallelism leaves the norms' and position embedding's gradients partial on
    each tp rank, to be summed over tp (labkit: one flat all-reduce; DTensor: each ``Partial`` placement).

    Call it before the strategy wraps the model: FSDP2 replaces the parameters (names stay, flags go), so
    the flagged parameters are remembered by name and flagged again when the hook runs."""
    if grid.size("tp") == 1 or not cfg.parallel.tp.sequence_parallel:
        return []
    if cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tp.dtensor import reduce_partial_grads

        return [lambda: reduce_partial_grads(model)]
    from labkit.parallel.tp.sequence import mark_sequence_parallel, sync_sequence_parallel_grads

    names = [name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]

    def sum_partial_gradients():
        params = dict(model.named_parameters())
        mark_sequence_parallel(*(params[name] for name in names))
        sync_sequence_parallel_grads(model, grid.axis_group("tp"))
    return [sum_partial_gradients]


def forward_backward_context(cfg, grid):
    """A context factory around each forward and backward: DTensor's vocabulary-parallel loss needs
    ``loss_parallel()`` around both; every other layout needs nothing."""
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tp.dtensor import loss_parallel_context

        return loss_parallel_context
    from contextlib import nullcontext

    return nullcontext


def tp_sharded_params(model: nn.Module) -> set[int]:
    """ids of the parameters labkit's tensor-parallel layers hold a *slice* of (the rest is replicated)."""
    from labkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
    from labkit.parallel.tp.model import VocabParallelEmbedding, VocabParallelHead

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
    (``dp_sharded``: ZeRO, FSDP), share 1/dp more; an expert under ep by the dp ranks at its ep coordinate only.
    Each pipeline stage holds its own layers (they add up over the pp ranks), but a second copy of a tied embedding
    has share 0 (:func:`second_copies`).
    """
    from torch.distributed.tensor import DTensor

    tp, dp = grid.size("tp"), grid.size(GRADIENT_AXIS)  # dp × cp: the ranks that hold the same parameters
    sharded, skip = tp_sharded_params(model), second_copies(model)
    shares = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in skip:  # counted where the original lives, but clipped here all the same
            shares.append((p, 0.0))
            continue
        if isinstance(p, DTensor):  # a DTensor knows its placements: sharded on a mesh axis means sliced
            on_tp, copies = _dtensor_holders(p, dp)
            on_tp = on_tp or id(p) in sharded
        elif is_expert(p):  # this rank's experts: held alike only by the ranks at its ep coordinate
            on_tp, copies = False, grid.size(EXPERT_GRADIENT_AXIS)
        else:
            on_tp, copies = id(p) in sharded, 1 if dp_sharded else dp
        shares.append((p, (1.0 if on_tp else 1.0 / tp) / copies))
    return shares


def _dtensor_holders(p, dp: int) -> tuple[bool, int]:
    """(sliced over tp, how many ranks of the gradient axis hold each of its elements) for a DTensor parameter.
    Its mesh's dimensions other than tp are data-parallel ones (FSDP2's: the gradient axis, whatever the device
    mesh calls it — dp_shard, dp_cp, cp — or HSDP's replica groups × shard group): an element is held once per
    rank of each dimension it is replicated over. A mesh with no data-parallel dimension (DTensor's tp alone)
    leaves every one of the dp replicas a copy."""
    names = p.device_mesh.mesh_dim_names or ()
    on_tp = any(name == "tp" and not (place.is_replicate() or place.is_partial())  # Shard, FSDP's _StridedShard
                for name, place in zip(names, p.placements))
    data = [dim for dim, name in enumerate(names) if name != "tp"]
    if not data:
        return on_tp, dp
    return on_tp, math.prod(p.device_mesh.size(dim) for dim in data if p.placements[dim].is_replicate())


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
    control.sum_over_ranks(squares, group=group)  # one number: not the gradients' traffic
    norm = float(squares.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p, _ in shares:
            if p.grad is not None:
                _local(p.grad).mul_(coef)
    return norm


def is_model_parallel(grid) -> bool:
    """Whether ranks hold different parts of the model: tp slices, pp stages or, under ep, other experts."""
    return grid.size("tp") * grid.size("pp") * grid.size("ep") > 1


def gather_tensor_parallel_state(state: dict, model: nn.Module, group) -> dict:
    """The whole model's weights from each tp rank's ``state`` (labkit's layers): every slice gathered over
    the tp ``group`` and put back in place, so a split run saves what a single process would have saved.
    A collective: every tp rank calls it. Entries a rank does not hold (an empty state) stay absent."""
    from labkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, TensorParallelAttention
    from labkit.parallel.tp.model import VocabParallelEmbedding, VocabParallelHead

    if not state:
        return state
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
        parts = control.all_gather_tensors(local, group=group)
        if rule == "qkv":  # each rank holds [q_r | k_r | v_r]: regroup as [q | k | v]
            parts = [torch.cat([p.chunk(3, dim=0)[i] for p in parts], dim=0) for i in range(3)]
            full[key] = torch.cat(parts, dim=0)
        else:
            full[key] = torch.cat(parts, dim=rule)
    return full


def whole_model_state(state: dict, model: nn.Module, cfg, grid) -> dict:
    """A split model's ``full_state_dict`` made whole, named as the GPT names it (collectives over tp and pp;
    the identity for a whole model)."""
    state = gather_experts(state, model, grid)
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "labkit":
        state = gather_tensor_parallel_state(state, model, grid.group("tp"))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if grid.size("tp") > 1 and cfg.parallel.tp.impl == "dtensor":
        from labkit.parallel.tp.dtensor import fused_qkv_state

        state = fused_qkv_state(state)  # the DTensor path splits q, k and v: joined as the GPT holds them
    if grid.size("pp") > 1:
        state = {model.gpt_name(k): v for k, v in state.items()}
        stages = control.all_gather_objects(state, group=grid.group("pp"))
        state = {k: v for stage in stages for k, v in stage.items()}  # wte from the first, lm_head from the last
    return state
