"""ZeRO's sharded optimizer: each rank steps and keeps the state of 1/p of the parameters.

:mod:`labkit.parallel.dp.zero` explains the stages and holds the strategies that use it. Here: the parameters
flattened (:class:`FlatShard`), cut into p equal slices, and :class:`ShardedOptimizer`, which wraps any
elementwise ``torch.optim`` class so that it steps rank r's slice only, then all-gathers the updated slices.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import axes, control
from labkit.comm import collectives as comm
from labkit.metrics.timers import CommTimer
from labkit.parallel.dp.ddp import bucket_params

# Optimizers whose update of each element depends only on that element's own history: these can
# be sharded over a flat buffer cut anywhere. (Adafactor keeps per-matrix row/column statistics.)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


class FlatShard:
    """Some parameters flattened, padded to a multiple of p, and rank r's slice of them (``param``).

    ``without_grad`` marks the parameters that had no gradient when this step's gradients were sharded."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / world)
        self.start = rank * self.shard_size
        flat = self.flatten([p.detach() for p in params], world)
        self.param = nn.Parameter(flat[self.start: self.start + self.shard_size].clone())
        self.without_grad = [False] * len(params)

    def flatten(self, tensors, world: int, dtype=None) -> torch.Tensor:
        flat = torch.zeros(self.shard_size * world, dtype=dtype or self.params[0].dtype, device=self.params[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: self.numel])
        return flat

    def views(self, flat: torch.Tensor):
        """Each parameter with its place in a full flat buffer."""
        offset = 0
        for p in self.params:
            yield p, flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    def shares(self, shares: dict[int, float], world: int) -> torch.Tensor:
        """This slice's per-element share of the squared norm (see ``ShardedOptimizer.clip_grad_norm``)."""
        flat = self.flatten([torch.full_like(p, shares.get(id(p), 0.0), dtype=torch.float64) for p in self.params],
                            world, dtype=torch.float64)
        return flat[self.start: self.start + self.shard_size]

    def skipped_elements(self, world: int) -> torch.Tensor:
        """True where this rank's slice holds a parameter that had no gradient."""
        flat = self.flatten([torch.full(p.shape, skip, dtype=torch.bool, device=p.device)
                             for p, skip in zip(self.params, self.without_grad)], world, dtype=torch.bool)
        return flat[self.start: self.start + self.shard_size]

    def unflatten_into_params(self, flat: torch.Tensor) -> None:
        for p, view in self.views(flat):
            p.data.copy_(view)


class ShardedOptimizer:
    """Wraps any elementwise ``torch.optim`` class so each rank holds 1/p of its state.

    ``ShardedOptimizer(groups, torch.optim.AdamW, timer, stage=1, lr=1e-3, betas=(0.9, 0.95))``

    Stages 1 and 2 all-gather the updated slices into the model after each step; at stage 3 the slices *are* the
    parameters (the model's own tensors are gathered unit by unit when used: :mod:`labkit.parallel.dp.zero3`), so the
    step ends with this rank's slices updated and nothing sent.

    With ``bucket_bytes`` each parameter group is cut into buckets (:func:`bucket_params`), each its
    own :class:`FlatShard` (stage 2 reduce-scatters them one by one from backward); without, one
    shard per group.

    ``process_group`` is the data-parallel axis's group (an :class:`~labkit.comm.axes.AxisGroup`: what it sends is
    counted on the timer the step set for that axis); ``timer`` takes the time the step stands still waiting for
    a gather (exposed communication).
    """

    def __init__(self, groups: list[dict], optimizer_class: type, timer: CommTimer, stage: int = 1,
                 process_group=None, bucket_bytes: float | None = None, **kwargs):
        if not issubclass(optimizer_class, ELEMENTWISE):
            raise ValueError(f"ZeRO shards a flat buffer cut anywhere, which needs an elementwise optimizer; "
                             f"{optimizer_class.__name__} keeps per-matrix statistics. Use adamw, adam or sgd, "
                             f"or parallel.dp.strategy=torch_ddp")
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedOptimizer implements ZeRO stages 1, 2 and 3, not {stage}")
        self.group = process_group  # the data-parallel group the state is sharded over (None: the world)
        torch_group = axes.process_group(process_group)  # an AxisGroup's, or the group itself
        self.rank, self.world = dist.get_rank(torch_group), dist.get_world_size(torch_group)
        self.timer, self.stage = timer, stage
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]  # frozen: not ours
        groups = [g for g in groups if g["params"]]
        pieces = [bucket_params(g["params"], bucket_bytes) if bucket_bytes else [g["params"]] for g in groups]
        shards = [[FlatShard(piece, self.rank, self.world) for piece in group] for group in pieces]
        self.shards = [shard for group in shards for shard in group]
        options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.inner = optimizer_class([{"params": [s.param for s in group], **o} for group, o in zip(shards, options)],
                                     **kwargs)
        self.param_groups = self.inner.param_groups  # so the LR schedule reaches the real optimizer
        self.state = self.inner.state
        self.prefetch = False  # leave the all-gathers running after the step (prefetch_into: the next forward)
        self.gather_order = list(range(len(self.shards)))  # the order the all-gathers are launched in
        self._gathers: dict[int, tuple] = {}  # shard index → (its all-gather in flight, the full buffer)

    def prefetch_into(self, model: nn.Module) -> None:
        """Overlap the parameter all-gathers with the next step's forward: :meth:`step` launches them in the order
        the forward uses the shards and leaves them running; a forward pre-hook on each module waits for the shards
        holding its own parameters (and puts them in place) just before it runs. Anything that reads the
        parameters another way calls :meth:`finish_gathers` first (checkpoints, the full state)."""
        shard_of = {id(p): i for i, shard in enumerate(self.shards) for p in shard.params}
        first_use = {}
        for position, p in enumerate(model.parameters()):
            if id(p) in shard_of:
                first_use.setdefault(shard_of[id(p)], position)
        self.gather_order = sorted(range(len(self.shards)), key=lambda i: first_use.get(i, len(first_use)))
        for module in model.modules():
            needed = sorted({shard_of[id(p)] for p in module.parameters(recurse=False) if id(p) in shard_of})
            if needed:
                module.register_forward_pre_hook(lambda _module, _args, needed=needed: self._finish(needed))
        self.prefetch = True

    def _finish(self, indices) -> None:
        for i in indices:
            self.finish_gather(i)

    def finish_gather(self, i: int) -> None:
        """Wait for shard ``i``'s all-gather (timed as exposed: compute stands still) and put it into the model."""
        pending = self._gathers.pop(i, None)
        if pending is None:
            return
        work, full = pending
        began = time.perf_counter()
        work.wait()
        self.timer.waited(time.perf_counter() - began)
        self.shards[i].unflatten_into_params(full)

    def finish_gathers(self) -> None:
        """Every all-gather still running waited for: the model's parameters are this step's everywhere."""
        for i in list(self._gathers):
            self.finish_gather(i)

    def reduce_scatter(self, shard: FlatShard, flat: torch.Tensor, async_op: bool = False):
        """Send ``flat`` (this rank's full local gradients of ``shard``) so that each rank gets the sum of its slice."""
        shard.param.grad = torch.empty_like(shard.param)
        return comm.reduce_scatter(shard.param.grad, flat, self.group, async_op=async_op)

    def shard_gradients(self) -> None:
        """Give each rank the averaged gradient of its own slice, by reduce-scatter, after backward.

        Stage 1 keeps the full local gradients (P_os does not shard them); stage 2 frees them."""
        for shard in self.shards:
            shard.without_grad = [p.grad is None for p in shard.params]
            flat = shard.flatten([torch.zeros_like(p) if p.grad is None else p.grad for p in shard.params], self.world)
            self.reduce_scatter(shard, flat)
            if self.stage == 2:
                for p in shard.params:
                    p.grad = None  # the full gradient is no longer needed: that is the saving
        self.average()

    def average(self) -> None:
        for shard in self.shards:
            shard.param.grad.div_(self.world)

    def clip_grad_norm(self, max_norm: float, shares: dict[int, float] | None = None, norm_group=None) -> float:
        """Global norm from the slices: Σ over ranks of each slice's squared norm.

        Beside tensor or pipeline parallelism the slices are of this rank's *part* of the model: then
        ``shares`` (parameter id → share, :func:`labkit.parallel.parallelize.norm_shares`) weighs each
        element's square and ``norm_group`` (None: the world) sums over every rank, not only the replicas.
        """
        if shares is None:
            squares = torch.stack([s.param.grad.double().pow(2).sum() for s in self.shards]).sum().reshape(1)
            comm.all_reduce(squares, self.group)
        else:
            squares = torch.stack([(s.shares(shares, self.world) * s.param.grad.double().pow(2)).sum()
                                   for s in self.shards]).sum().reshape(1)
            control.sum_over_ranks(squares, group=norm_group)  # one number: not the replicas' gradient traffic
        total = float(squares.sqrt())
        if total > max_norm:
            for s in self.shards:
                s.param.grad.mul_(max_norm / (total + 1e-6))
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's slices, then all-gather every shard's updated slices into the model's parameters —
        waited for here, or (:meth:`prefetch_into`) by the next forward, as it reaches each shard's layers."""
        self.finish_gathers()  # a shard the last forward did not reach (a frozen or unused layer)
        kept = [self._keep_skipped(s) for s in self.shards]
        self.inner.step()
        for i in self.gather_order:
            shard = self.shards[i]
            if kept[i] is not None:
                self._put_back(shard, *kept[i])
            if self.stage == 3:
                continue  # the slices are the parameters: each unit's next forward gathers them (dp.zero3)
            full = torch.empty(shard.shard_size * self.world, dtype=shard.param.dtype, device=shard.param.device)
            self._gathers[i] = (comm.all_gather(full, shard.param.data, self.group, async_op=True), full)
        if not self.prefetch:
            self.finish_gathers()

    def _keep_skipped(self, shard: FlatShard):
        """The values and optimizer state of the elements whose parameters had no gradient, to put back after the
        step: a torch optimizer skips such a parameter, and weight decay must not shrink it."""
        if not any(shard.without_grad):
            return None
        mask = shard.skipped_elements(self.world)
        state = {k: v[mask].clone() for k, v in self.inner.state.get(shard.param, {}).items()
                 if torch.is_tensor(v) and v.shape == shard.param.shape}
        return mask, shard.param.data[mask].clone(), state

    def _put_back(self, shard: FlatShard, mask: torch.Tensor, values: torch.Tensor, state: dict) -> None:
        shard.param.data[mask] = values
        for k, v in self.inner.state[shard.param].items():
            if torch.is_tensor(v) and v.shape == shard.param.shape:
                v[mask] = state[k] if k in state else 0  # a state the step just created starts at zero

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.param.grad = None
            for p in shard.params:
                p.grad = None

    def state_dict(self) -> dict:
        self.finish_gathers()
        return self.inner.state_dict()

    def checkpoint_state(self) -> dict:
        """This rank's slice of the optimizer state, as slices of one whole flat tensor per shard.

        Each shard's flat buffer (its parameters end to end, the padding left out) is a DTensor cut in
        ``Shard(0)`` over the data-parallel ranks: ``ceil(numel / p)`` elements each, exactly this rank's slice. DCP
        records which elements of the whole each rank wrote, so a checkpoint saved by 4 ranks loads on 2 or 3
        (:mod:`labkit.fault.reshard`); the buckets do not depend on the world size. The step count is the same on
        every rank: a plain tensor, saved once.
        """
        self.finish_gathers()
        init_optimizer_state(self.inner)
        return {f"shard{i}": {k: self.whole(s, v) for k, v in self.inner.state[s.param].items()}
                for i, s in enumerate(self.shards)}

    def _mesh(self):
        """The data-parallel group as a one-dimensional DeviceMesh (made once), for the DTensors of the state."""
        if getattr(self, "_device_mesh", None) is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = axes.process_group(self.group) or dist.group.WORLD
            self._device_mesh = DeviceMesh.from_group(group, self.shards[0].param.device.type)
        return self._device_mesh

    def whole(self, shard: FlatShard, value: torch.Tensor):
        """A tensor of ``shard``'s slice (its weights at stage 3, an optimizer state) as what it is a slice of: a
        DTensor view of the slice, padding cut off, in the shard's whole flat tensor; a tensor not per element (the
        step count) as it is."""
        if not torch.is_tensor(value) or value.shape != shard.param.shape:
            return value
        from torch.distributed.tensor import DTensor, Shard

        valid = max(0, min(shard.shard_size, shard.numel - shard.start))
        return DTensor.from_local(value[:valid], self._mesh(), [Shard(0)], run_check=False,
                                  shape=torch.Size([shard.numel]), stride=(1,))

    @torch.no_grad()
    def reload_shards_from_params(self) -> None:
        """Copy the (just loaded) model parameters into this rank's flat slice."""
        self._gathers.clear()  # what was in flight is of the parameters the load replaced
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
