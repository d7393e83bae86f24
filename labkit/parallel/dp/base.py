"""What every parallel strategy provides, with the plain single-replica defaults.

A strategy works on the axis its gradients reduce over, its ``reduces_over`` (:mod:`labkit.parallel.spec`; for
every strategy the rank grid's ``labkit.parallel.mesh.GRADIENT_AXIS``: dp, and with context parallelism dp × cp,
whose ranks hold the same parameters and see different tokens): ``self.group`` is
that axis's group (an :class:`~labkit.comm.axes.AxisGroup`: the trainer's step counts what is sent on it on the
strategy's ``comm_timer``), ``self.process_group`` torch's group behind it, ``self.replicas`` its size and
``self.src`` the global rank of its first member. The
training loop talks to a strategy only through these methods, so adding a strategy never touches the loop:

* ``wrap(model)`` → the module to call (after rank 0's weights are copied everywhere);
* ``build_optimizer(model, optim_cfg)`` → the optimizer (a sharded one for ZeRO);
* ``no_sync(module)`` → a context in which backward does not communicate (all micro-batches but
  the last under gradient accumulation);
* ``sync_gradients(module)`` → after the last backward: make gradients consistent across ranks,
  running ``gradient_hooks`` on the whole local gradients once they are summed, before anything
  shards them (where a split model sums a tied embedding's two copies);
* ``clip_grad_norm(model, optimizer, max_norm)`` → the *global* gradient norm, clipping to it;
* ``after_optimizer_step(model, step)`` → periodic work (local SGD's parameter averaging);
* ``full_state_dict(model, everywhere=False)`` → the whole model's weights: a collective for sharded
  strategies, so called on every rank; on global rank 0 only (saving) or on every rank (comparing);
* ``checkpoint_state(model, optimizer)`` / ``load_checkpoint_state(...)`` → model and optimizer
  state for ``torch.distributed.checkpoint``, sharded wherever the strategy shards;
* ``memory_breakdown(model, optimizer)`` → bytes this rank holds in parameters, gradients and
  optimizer state, measured from the tensors themselves;
* ``close()`` → undo anything set up outside the model.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from labkit.metrics.timers import CommTimer
from labkit.optim import build_optimizer
from labkit.parallel.parallelize import clip_grad_norm_shared, is_model_parallel, norm_shares
from labkit.parallel.spec import StrategyFacts


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storage behind ``tensors`` (views of one buffer are counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    inner = getattr(optimizer, "inner", optimizer)
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


class Strategy(StrategyFacts):  # what it declares without being built: labkit.parallel.spec
    name = "base"
    exposed_comm_measurable = True
    compressor = None  # set by strategies that compress gradients (comm.compression)
    shards_meta = False  # wraps a model still on the meta device, then each rank makes only its shards real

    def __init__(self, cfg, env):
        self.cfg = cfg
        self.env = env
        self.comm_timer = CommTimer()
        self.group = env.grid.axis_group(self.reduces_over)  # replicas average over dp (× cp) of the mesh
        self.process_group = self.group.group  # torch's, for torch's own engines (DDP, PowerSGD's hook)
        self.replicas = env.grid.size(self.reduces_over)
        self.src = env.grid.first_rank(self.reduces_over)  # the replica whose weights every other starts from
        self.gradient_hooks: list = []  # run by sync_gradients on final whole gradients (run_gradient_hooks)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
        return build_optimizer(model, optim_cfg)

    def no_sync(self, module: nn.Module):
        return nullcontext()

    def sync_gradients(self, module: nn.Module) -> None:
        self.run_gradient_hooks()

    def run_gradient_hooks(self) -> None:
        for hook in self.gradient_hooks:
            hook()

    def comm_stats(self, comm_bytes: int) -> dict:
        """This step's gradient bytes before and after compression, and time spent compressing."""
        if self.compressor is None:
            return {"raw_bytes": comm_bytes, "compression_ratio": 1.0, "compress_s": 0.0}
        stats = self.compressor.collect_stats()
        ratio = stats["raw_bytes"] / stats["wire_bytes"] if stats["wire_bytes"] else None
        return {"raw_bytes": stats["raw_bytes"], "compression_ratio": ratio, "compress_s": stats["compress_s"]}

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        """Called after every optimizer step (periodic synchronisation lives here)."""

    def clip_grad_norm(self, model: nn.Module, optimizer, max_norm: float) -> float:
        if is_model_parallel(self.env.grid):  # slices on other ranks: one norm over the whole model
            return clip_grad_norm_shared(norm_shares(model, self.env.grid, dp_sharded=self.zero_stage >= 3), max_norm)
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def full_state_dict(self, model: nn.Module, everywhere: bool = False) -> dict:
        """The whole model's weights, every tensor whole (not sharded). Call it on every rank: for a
        sharded strategy it is a collective.

        ``everywhere`` says where the weights must arrive:

        * ``False`` (the default) — on global rank 0, for **saving**: ``labkit/train.py`` writes
          ``final_model.pt`` from rank 0 alone. A sharded strategy gathers onto rank 0 only, into CPU
          memory, and returns an empty dict on the other ranks (FSDP2: ``cpu_offload=True``), so no
          rank but one ever holds the whole model;
        * ``True`` — on every rank, for **comparing** (replicas against each other, a test against
          single-process training, ``tests/parallel/test_full_state_dict.py``): each rank gets every
          tensor, where the strategy keeps its parameters (FSDP2: ``full_state_dict=True,
          cpu_offload=False``, an all-gather to all).

        Strategies that replicate the model hold it whole on every rank, so both modes return it
        everywhere. A model split over tp or pp returns this rank's part whole in both modes:
        ``labkit.parallel.parallelize.whole_model_state`` then gathers the parts over tp and pp.
        """
        return model.state_dict()

    def checkpoint_state(self, model: nn.Module, optimizer) -> dict:
        """Model and optimizer state as a DCP state dict (loaded in place by ``dcp.load``).

        torch's ``get_state_dict`` names every entry by its parameter's path in the model, keeps
        DTensors sharded (FSDP2) and creates the optimizer's state if no step has run yet, so a
        fresh run has tensors of the right shapes for the checkpoint to be loaded into.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict  # ~0.7 s to import: only when used

        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_checkpoint_state(self, model: nn.Module, optimizer, state: dict) -> None:
        """Put a loaded :meth:`checkpoint_state` back into the model and optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def close(self) -> None:
        """Undo anything set up outside the model (called once, when training ends)."""

    def memory_breakdown(self, model: nn.Module, optimizer) -> dict:
        params = list(model.parameters())
        return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(p.grad for p in params),
                "optimizer_bytes": tensor_bytes(optimizer_state_tensors(optimizer))}
