"""Communicating less often: local SGD and DiLoCo.

Synchronising gradients every step keeps replicas identical but pays for an all-reduce every
step. The alternative: let each replica train alone for H steps, then reconcile.

* **Local SGD** (Stich 2019; "model averaging"): every H steps, average the parameters. With
  H = 1 and plain SGD it is exactly gradient averaging — averaging the results of one SGD step
  is averaging the gradients. Larger H divides communication by H; replicas drift apart in
  between, which costs some accuracy per step.
* **DiLoCo** (Douillard et al. 2023): each replica runs its inner optimizer (AdamW) for H steps;
  then the *pseudo-gradient* Δ = θ_global − mean(θ_local) is applied to the global parameters
  by an outer optimizer — SGD with Nesterov momentum — and every replica restarts from the
  result. The outer momentum lets H be large (hundreds of steps) with little loss.

Both are strategies (``labkit.parallel.dp.base.Strategy``) whose gradients are never synchronised;
the trainer calls ``after_optimizer_step`` and they communicate when their period comes. They are
chosen by ``comm.sync`` (registry ``SYNC_STRATEGIES``, :mod:`labkit.parallel.spec`) and replace
``parallel.dp.strategy``'s per-step gradient synchronisation.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import collectives as comm
from labkit.comm.axes import process_group
from labkit.parallel.dp.base import Strategy
from labkit.parallel.dp.ddp import ReplicatedModule
from labkit.parallel.spec import IMPLS, SYNC_STRATEGIES, refusing

# every model-parallel layout, whatever its implementation (layout_checks says it when comm.sync asks for one)
WHOLE_REPLICAS = {pair: reason for axis in IMPLS for pair, reason in refusing(
    axis, "replicas that drift apart between synchronisations are whole models").items()}


def average_parameters(params: list[torch.Tensor], group=None, *, timer=None) -> None:
    """Replace each parameter by its mean over ranks (one flat all-reduce; counted on ``timer`` when one is given,
    as the consistency lab does outside the trainer's step)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    comm.all_reduce(flat, group, timer=timer)
    flat.div_(dist.get_world_size(process_group(group)))
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


@SYNC_STRATEGIES.register
class LocalSGD(Strategy):
    name, order = "local_sgd", 10
    refuses = WHOLE_REPLICAS
    advice = "local SGD: train locally, average the weights every H steps"  # the tuning flowchart's line

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        """``comm.sync_every``; and, when chosen, nothing else may synchronise gradients."""
        c, strategy, found = cfg.comm, cfg.parallel.dp.strategy, []
        if c.sync_every < 1:
            found.append(f"comm.sync_every: must be >= 1 step, got {c.sync_every}")
        if c.sync == cls.name and (strategy != "torch_ddp" or c.compression != "none"):
            found.append(f"comm.sync={c.sync} replaces per-step gradient synchronisation, so it cannot be combined "
                         f"with parallel.dp.strategy={strategy} or comm.compression={c.compression}; "
                         "leave those at torch_ddp / none")
        return found

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        self.every = cfg.comm.sync_every

    def wrap(self, model: nn.Module) -> nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        return ReplicatedModule(model, self.group, self.src)

    def sync_gradients(self, module: nn.Module) -> None:
        self.comm_timer.backward_done()  # no gradient traffic: replicas train alone

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        if self.due(step):
            average_parameters(self.params, self.group)

    def checkpoint_state(self, model: nn.Module, optimizer) -> dict:
        """Between synchronisations the replicas differ, so each rank saves its own under its own key."""
        return {f"replica{self.env.rank}_of_{self.env.world_size}": super().checkpoint_state(model, optimizer)}

    def load_checkpoint_state(self, model: nn.Module, optimizer, state: dict) -> None:
        super().load_checkpoint_state(model, optimizer, state[f"replica{self.env.rank}_of_{self.env.world_size}"])


@SYNC_STRATEGIES.register
class DiLoCo(LocalSGD):
    name, order = "diloco", 20
    advice = "DiLoCo: local steps, then an outer Nesterov step on the averaged change"

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapped = super().wrap(model)
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.global_params, lr=self.cfg.comm.outer_lr,
                                     momentum=self.cfg.comm.outer_momentum, nesterov=True)
        for p in self.global_params:  # zeros behave as SGD's lazily-created buffer, and can be checkpointed
            self.outer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return wrapped

    def checkpoint_state(self, model: nn.Module, optimizer) -> dict:
        """Each replica's state, plus the outer loop's: the global parameters and their momentum."""
        outer = {str(i): {"param": p, "momentum": self.outer.state[p]["momentum_buffer"]}
                 for i, p in enumerate(self.global_params)}
        return {**super().checkpoint_state(model, optimizer), "outer": outer}  # loaded in place

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        if not self.due(step):
            return
        average_parameters(self.params, self.group)  # mean of the replicas' θ_local
        with torch.no_grad():
            for global_p, local_p in zip(self.global_params, self.params):
                global_p.grad = global_p - local_p  # the pseudo-gradient Δ
            self.outer.step()
            for global_p, local_p in zip(self.global_params, self.params):
                local_p.copy_(global_p)

