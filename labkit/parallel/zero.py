"""ZeRO stages 1 and 2, written out (Rajbhandari et al. 2020).

Plain data parallelism keeps p identical copies of everything. For Adam that is 16 bytes per
parameter on every rank (fp32 weights 4, gradients 4, two moments 8), although each rank only
*needs* the optimizer state of the parameters it updates. ZeRO removes the redundancy:

* **stage 1** shards the optimizer state: all parameters are flattened into one buffer, cut into
  p equal slices; rank r keeps optimizer state only for slice r, steps only slice r, and an
  all-gather then puts the updated slices back together on every rank. Optimizer memory: 1/p.
* **stage 2** also shards gradients: instead of all-reducing (every rank gets every averaged
  gradient), a reduce-scatter gives rank r just the averaged gradients of slice r — half the
  traffic of an all-reduce — and the full local gradients are freed right after.

Same arithmetic as unsharded training (the optimizers here are elementwise), so the model is the
same; what changes is memory per rank and the pattern of communication.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import collectives as comm
from labkit.metrics.timers import CommTimer
from labkit.optim import optimizer_class_and_kwargs, param_groups
from labkit.parallel.base import Strategy
from labkit.parallel.ddp import BucketedDDP, ReplicatedModule
from labkit.parallel.parallelize import is_model_parallel, norm_shares
from labkit.parallel.spec import STRATEGIES

# Optimizers whose update of each element depends only on that element's own history: these can
# be sharded over a flat buffer cut anywhere. (Adafactor keeps per-matrix row/column statistics.)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


class FlatShard:
    """One parameter group flattened, padded to a multiple of p, and rank r's slice of it."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / world)
        self.start = rank * self.shard_size
        flat = self.flatten([p.detach() for p in params], world)
        self.param = nn.Parameter(flat[self.start: self.start + self.shard_size].clone())

    def flatten(self, tensors, world: int, dtype=None) -> torch.Tensor:
        flat = torch.zeros(self.shard_size * world, dtype=dtype or self.params[0].dtype, device=self.params[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: self.numel])
        return flat

    def shares(self, shares: dict[int, float], world: int) -> torch.Tensor:
        """This slice's per-element share of the squared norm (see ``ShardedOptimizer.clip_grad_norm``)."""
        flat = self.flatten([torch.full_like(p, shares.get(id(p), 0.0), dtype=torch.float64) for p in self.params],
                            world, dtype=torch.float64)
        return flat[self.start: self.start + self.shard_size]

    def unflatten_into_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


class ShardedOptimizer:
    """Wraps any elementwise ``torch.optim`` class so each rank holds 1/p of its state.

    ``ShardedOptimizer(groups, torch.optim.AdamW, timer, stage=1, lr=1e-3, betas=(0.9, 0.95))``
    """

    def __init__(self, groups: list[dict], optimizer_class: type, timer: CommTimer, stage: int = 1,
                 process_group=None, **kwargs):
        if not issubclass(optimizer_class, ELEMENTWISE):
            raise ValueError(f"ZeRO shards a flat buffer cut anywhere, which needs an elementwise optimizer; "
                             f"{optimizer_class.__name__} keeps per-matrix statistics. Use adamw, adam or sgd, "
                             f"or parallel.dp.strategy=torch_ddp")
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer implements ZeRO stages 1 and 2, not {stage}; stage 3 is fsdp2")
        self.group = process_group  # the data-parallel group the state is sharded over (None: the world)
        self.rank, self.world = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.timer, self.stage = timer, stage
        groups = [g for g in groups if g["params"]]
        self.shards = [FlatShard(g["params"], self.rank, self.world) for g in groups]
        options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.inner = optimizer_class([{"params": [s.param], **o} for s, o in zip(self.shards, options)], **kwargs)
        self.param_groups = self.inner.param_groups  # so the LR schedule reaches the real optimizer
        self.state = self.inner.state

    def shard_gradients(self) -> None:
        """Give each rank the averaged gradient of its own slice (stage 2: by reduce-scatter)."""
        for shard in self.shards:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.params]
            flat = shard.flatten(grads, self.world)
            if self.stage == 1:  # gradients were already all-reduced by the DDP part
                shard.param.grad = flat[shard.start: shard.start + shard.shard_size].clone()
            else:
                shard.param.grad = torch.empty_like(shard.param)
                comm.reduce_scatter(shard.param.grad, flat, self.timer, group=self.group)
                shard.param.grad.div_(self.world)
                for p in shard.params:
                    p.grad = None  # the full gradient is no longer needed: that is the saving

    def clip_grad_norm(self, max_norm: float, shares: dict[int, float] | None = None, norm_group=None) -> float:
        """Global norm from the slices: Σ over ranks of each slice's squared norm.

        Beside tensor or pipeline parallelism the slices are of this rank's *part* of the model: then
        ``shares`` (parameter id → share, :func:`labkit.parallel.parallelize.norm_shares`) weighs each
        element's square and ``norm_group`` (None: the world) sums over every rank, not only the replicas.
        """
        if shares is None:
            squares = torch.stack([s.param.grad.double().pow(2).sum() for s in self.shards]).sum().reshape(1)
            comm.all_reduce(squares, self.timer, group=self.group)
        else:
            squares = torch.stack([(s.shares(shares, self.world) * s.param.grad.double().pow(2)).sum()
                                   for s in self.shards]).sum().reshape(1)
            dist.all_reduce(squares, group=norm_group)  # one number: not the replicas' gradient traffic
        total = float(squares.sqrt())
        if total > max_norm:
            for s in self.shards:
                s.param.grad.mul_(max_norm / (total + 1e-6))
        return total

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for shard in self.shards:
            full = torch.empty(shard.shard_size * self.world, dtype=shard.param.dtype, device=shard.param.device)
            comm.all_gather(full, shard.param.data, self.timer, group=self.group)
            shard.unflatten_into_params(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.param.grad = None
            for p in shard.params:
                p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def checkpoint_state(self) -> dict:
        """This rank's slice of the optimizer state, under a key only this rank writes.

        DCP treats a plain tensor saved by every rank under the same name as replicated and keeps
        one copy; each rank's slice is different, so the key names the rank (and the world size:
        a checkpoint written by 4 ranks cannot be loaded by 2 without re-slicing).
        """
        init_optimizer_state(self.inner)
        return {f"rank{self.rank}_of_{self.world}": {
            str(i): dict(self.inner.state[s.param]) for i, s in enumerate(self.shards)}}

    @torch.no_grad()
    def reload_shards_from_params(self) -> None:
        """Copy the (just loaded) model parameters into this rank's flat slice."""
        for s in self.shards:
            s.param.copy_(s.flatten([p.detach() for p in s.params], self.world)[s.start: s.start + s.shard_size])


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily-built state (moments, step) by one step with lr 0 and zero grads,
    so that a checkpoint has tensors to be loaded into. Parameters are left unchanged."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


class _ZeroMixin:
    stage = 1

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        found = super().problems(cfg, world)
        if cfg.parallel.dp.strategy == cls.name and cfg.optim.name == "adafactor":
            found.append(f"parallel.dp.strategy={cls.name} shards a flat buffer, which needs an elementwise "
                         "optimizer; optim.name=adafactor keeps per-matrix statistics. Use optim.name=adamw, "
                         "or parallel.dp.strategy=torch_ddp / fsdp2")
        return found

    def build_optimizer(self, model: nn.Module, optim_cfg) -> ShardedOptimizer:
        cls, kwargs = optimizer_class_and_kwargs(optim_cfg)
        self.optimizer = ShardedOptimizer(param_groups(model, optim_cfg), cls, self.comm_timer, self.stage,
                                          process_group=self.group, **kwargs)
        return self.optimizer

    def clip_grad_norm(self, model: nn.Module, optimizer: ShardedOptimizer, max_norm: float) -> float:
        if is_model_parallel(self.env.grid):
            shares = norm_shares(model, self.env.grid, dp_sharded=True)
            return optimizer.clip_grad_norm(max_norm, {id(p): share for p, share in shares})
        return optimizer.clip_grad_norm(max_norm)

    def checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # imported when used: ~0.7 s

        return {"model": get_model_state_dict(model), "optim": optimizer.checkpoint_state()}

    def load_checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        optimizer.reload_shards_from_params()  # the optimizer state was loaded in place

    def memory_breakdown(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        from labkit.parallel.base import tensor_bytes

        shard_params = [s.param for s in optimizer.shards]
        local = super().memory_breakdown(model, optimizer)
        local["grad_bytes"] += tensor_bytes(p.grad for p in shard_params)
        local["param_bytes"] += tensor_bytes(shard_params)  # the optimizer's own copy of its slice
        return local


@STRATEGIES.register
class Zero1(_ZeroMixin, BucketedDDP):
    """Gradients all-reduced in overlapping buckets (as ddp_bucketed); optimizer state sharded."""

    name, stage = "zero1", 1
    order, zero_stage, compresses = 40, 1, False

    @classmethod
    def wire_factor(cls, accum: int = 1) -> float:
        """DDP's all-reduce, plus the all-gather of the updated parameters."""
        return 3

    def sync_gradients(self, module: nn.Module) -> None:
        super().sync_gradients(module)
        self.optimizer.shard_gradients()


@STRATEGIES.register
class Zero2(_ZeroMixin, Strategy):
    """Gradients reduce-scattered to their owners after backward; optimizer state sharded."""

    name, stage = "zero2", 2
    order, zero_stage = 50, 2  # reduce-scatter + all-gather: the all-reduce's bytes (wire_factor 2)
    model_parallel = {"tp": ("labkit",), "pp": ("labkit", "torch")}
    model_parallel_note = "ZeRO flattens plain gradient tensors into one buffer, and DTensor's are DTensors"

    def wrap(self, model: nn.Module) -> nn.Module:
        return ReplicatedModule(model, self.comm_timer, self.group, self.src)

    def sync_gradients(self, module: nn.Module) -> None:
        self.comm_timer.backward_done()
        self.run_gradient_hooks()  # on the whole local gradients, before they are reduce-scattered away
        self.optimizer.shard_gradients()
