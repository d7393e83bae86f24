"""ZeRO stages 1 and 2, written out (Rajbhandari et al. 2020).

Plain data parallelism keeps p identical copies of everything. For Adam that is 16 bytes per
parameter on every rank (fp32 weights 4, gradients 4, two moments 8), although each rank only
*needs* the optimizer state of the parameters it updates. ZeRO removes the redundancy, and sends
exactly what DDP's ring all-reduce sends, 2Ψ(p−1)/p per rank, split in two halves:

* **stage 1** (P_os) shards the optimizer state: the parameters are flattened into buckets of
  ``parallel.dp.bucket_mb`` (last parameter first, within a parameter group), each cut into p
  equal slices. A reduce-scatter per bucket gives rank r the averaged gradient of its slices
  (Ψ(p−1)/p in all), rank r steps only its slices, and an all-gather puts the updated slices back
  together on every rank (Ψ(p−1)/p), running into the next step's forward: each layer waits for
  its own bucket's slices just before it runs (``ShardedOptimizer.prefetch_into``), so the gather
  hides behind the layers before it. Optimizer memory: 1/p. The reduce-scatters are sent from
  backward, as stage 2's are (below), so they hide behind the layers still computing; the full
  local gradients stay until the step is over: the paper's P_os keeps them (gradient memory Ψ).
* **stage 2** (P_os+g) also shards the gradients: the moment a bucket's last gradient is ready a
  backward hook copies the bucket's gradients into one buffer, frees them, and launches that
  bucket's reduce-scatter while backward goes on computing earlier layers (one bucket in flight
  at a time). Each rank keeps only its slice of every bucket: gradient memory Ψ/p plus the
  buckets being filled and sent.

Parameters without a gradient (frozen, or unused this step) are left alone, as a torch optimizer
leaves them: their elements of the flat slice are put back after the step, state included. Same
arithmetic as unsharded training otherwise (the optimizers here are elementwise), so the model is
the same; what changes is memory per rank and the pattern of communication.

Stage 3 (P_os+g+p) shards the weights too, on top of stage 2: :mod:`labkit.parallel.dp.zero3`.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from labkit.metrics.timers import CommTimer
from labkit.optim import optimizer_class_and_kwargs, param_groups
from labkit.parallel.dp.base import Strategy
from labkit.parallel.dp.ddp import ReplicatedModule
from labkit.parallel.parallelize import is_model_parallel, norm_shares
from labkit.parallel.spec import SAME_PARAMETERS_EVERYWHERE, STRATEGIES, refusing
from labkit.parallel.dp.zero_optimizer import ShardedOptimizer

# what zero1 and zero2 do not run beside (zero3 declares its own)
ZERO_REFUSES = {**refusing("tp", "ZeRO flattens plain gradient tensors into one buffer, and DTensor's are DTensors",
                           ("dtensor",)),
                **refusing("ep", SAME_PARAMETERS_EVERYWHERE)}


class _ZeroMixin:
    """What both stages share: buckets reduce-scattered from backward hooks (:class:`OverlappedReduceScatter`),
    or after backward beside a split model (tp or pp), whose gradient hooks need the whole local gradients
    first, and whose torch pipeline cannot hold backward hooks back until a stage's last micro-batch."""
    stage = 1

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        self.overlap: OverlappedReduceScatter | None = None

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        found = super().problems(cfg, world)
        if cfg.parallel.dp.strategy == cls.name and cfg.optim.name == "adafactor":
            found.append(f"parallel.dp.strategy={cls.name} shards a flat buffer, which needs an elementwise "
                         "optimizer; optim.name=adafactor keeps per-matrix statistics. Use optim.name=adamw, "
                         "or parallel.dp.strategy=torch_ddp / fsdp2")
        return found

    def wrap(self, model: nn.Module) -> nn.Module:
        return ReplicatedModule(model, self.group, self.src)

    def build_optimizer(self, model: nn.Module, optim_cfg) -> ShardedOptimizer:
        """Sharded in buckets of ``parallel.dp.bucket_mb``, sent from backward (beside a split model: after it,
        one at a time, so that only one bucket's flat copy of the gradients exists at once)."""
        cls, kwargs = optimizer_class_and_kwargs(optim_cfg)
        self.optimizer = ShardedOptimizer(param_groups(model, optim_cfg), cls, self.comm_timer, self.stage,
                                          process_group=self.group,
                                          bucket_bytes=self.cfg.parallel.dp.bucket_mb * 2**20, **kwargs)
        if not is_model_parallel(self.env.grid):
            self.overlap = OverlappedReduceScatter(self.optimizer, self.comm_timer, keep_grads=self.stage == 1)
            self.optimizer.prefetch_into(model)  # the parameter all-gathers run into the next forward
        return self.optimizer

    @contextmanager
    def _no_sync(self):
        self.overlap.syncing = False
        try:
            yield
        finally:
            self.overlap.syncing = True

    def no_sync(self, module: nn.Module):
        return self._no_sync() if self.overlap is not None else nullcontext()

    def sync_gradients(self, module: nn.Module) -> None:
        self.comm_timer.backward_done()
        if self.overlap is not None:
            self.overlap.finish()
            return
        self.run_gradient_hooks()  # on the whole local gradients, before they are reduce-scattered (away)
        self.optimizer.shard_gradients()

    def clip_grad_norm(self, model: nn.Module, optimizer: ShardedOptimizer, max_norm: float) -> float:
        if is_model_parallel(self.env.grid):
            shares = norm_shares(model, self.env.grid, dp_sharded=True)
            return optimizer.clip_grad_norm(max_norm, {id(p): share for p, share in shares})
        return optimizer.clip_grad_norm(max_norm)

    def full_state_dict(self, model: nn.Module, everywhere: bool = False) -> dict:
        self.optimizer.finish_gathers()  # the parameters this step's optimizer made, everywhere
        return super().full_state_dict(model, everywhere)

    def close(self) -> None:
        if getattr(self, "optimizer", None) is not None:
            self.optimizer.finish_gathers()  # nothing left in flight when the process group goes
        super().close()

    def checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # imported when used: ~0.7 s

        optimizer.finish_gathers()
        return {"model": get_model_state_dict(model), "optim": optimizer.checkpoint_state()}

    def load_checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        optimizer.reload_shards_from_params()  # the optimizer state was loaded in place

    def memory_breakdown(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        from labkit.parallel.dp.base import tensor_bytes

        shard_params = [s.param for s in optimizer.shards]
        local = super().memory_breakdown(model, optimizer)
        local["grad_bytes"] += tensor_bytes(p.grad for p in shard_params)
        local["param_bytes"] += tensor_bytes(shard_params)  # the optimizer's own copy of its slice
        return local


@STRATEGIES.register
class Zero1(_ZeroMixin, Strategy):
    """Gradients reduce-scattered to their owners bucket by bucket from backward hooks, the full local gradients
    kept; optimizer state sharded (P_os)."""

    name, stage = "zero1", 1
    order, zero_stage = 40, 1  # reduce-scatter + all-gather: the all-reduce's bytes (wire_factor 2)
    refuses = ZERO_REFUSES


class OverlappedReduceScatter:
    """ZeRO's backward hooks: each bucket's gradients, as they become ready, are copied into the bucket's
    flat buffer (and, for ZeRO-2, freed: ``keep_grads=False``); the bucket's reduce-scatter starts when its last
    one arrives, and runs while backward computes earlier layers. One bucket is in flight at a time (the next
    launch waits for it), so a ZeRO-2 rank holds its gradient slices (Ψ/p) plus at most a bucket being filled
    and one being sent — overlap needs both; a ZeRO-1 rank holds Ψ besides. A bucket of one parameter whose size
    divides by p sends autograd's gradient itself, without a copy.

    ``peak_bytes`` is the most gradient bytes alive at once in the last step — parameters' ``.grad``, bucket
    buffers and the slices — summed at every hook (measured by counting the live tensors' sizes)."""

    def __init__(self, optimizer: ShardedOptimizer, timer: CommTimer, keep_grads: bool = False):
        self.optimizer, self.timer, self.syncing, self.keep_grads = optimizer, timer, True, keep_grads
        for i, shard in enumerate(optimizer.shards):
            for j, p in enumerate(shard.params):
                p.register_post_accumulate_grad_hook(self._hook(i, j))
        self.peak_bytes = 0
        self._reset()

    def _reset(self) -> None:
        self.flats: dict[int, torch.Tensor] = {}
        self.ready: dict[int, set[int]] = {i: set() for i in range(len(self.optimizer.shards))}
        self.launched: set[int] = set()
        self.in_flight = None
        self.live_bytes = self._step_peak = sum(_nbytes(p.grad) for s in self.optimizer.shards for p in s.params)

    def _count(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self._step_peak = max(self._step_peak, self.live_bytes)

    def _views(self, i: int) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Bucket ``i``'s parameters with their places in its flat buffer (allocated, zeroed, on first use)."""
        shard = self.optimizer.shards[i]
        if i not in self.flats:
            self.flats[i] = torch.zeros(shard.shard_size * self.optimizer.world, dtype=shard.param.dtype,
                                        device=shard.param.device)
            self._count(_nbytes(self.flats[i]))
        return list(shard.views(self.flats[i]))

    def _hook(self, i: int, j: int):
        def on_grad_ready(p: nn.Parameter) -> None:
            if not self.syncing:
                return  # gradient accumulation: keep summing locally
            self.timer.grad_ready()
            self._count(_nbytes(p.grad))  # autograd's new gradient
            if self._adopts(i, p.grad):  # a bucket of one parameter, no padding: its gradient is the buffer
                self.flats[i] = p.grad.detach().view(-1)
            else:
                with torch.no_grad():
                    self._views(i)[j][1].copy_(p.grad)
                if not self.keep_grads:
                    self._count(-_nbytes(p.grad))
            if not self.keep_grads:
                p.grad = None  # in the bucket's buffer now: the full gradient is freed once it is sent
            self.ready[i].add(j)
            if len(self.ready[i]) == len(self.optimizer.shards[i].params):
                self._launch(i)

        return on_grad_ready

    def _adopts(self, i: int, grad: torch.Tensor) -> bool:
        shard = self.optimizer.shards[i]
        return (not self.keep_grads and len(shard.params) == 1 and i not in self.flats and grad.is_contiguous()
                and shard.numel == shard.shard_size * self.optimizer.world)

    def _wait(self) -> None:
        if self.in_flight is not None:
            i, work = self.in_flight
            work.wait()
            self._count(-_nbytes(self.flats.pop(i)))
            self.in_flight = None

    def _launch(self, i: int) -> None:
        shard = self.optimizer.shards[i]
        views = self._views(i)
        shard.without_grad = [j not in self.ready[i] and p.grad is None for j, (p, _) in enumerate(views)]
        with torch.no_grad():
            for j, (p, view) in enumerate(views):
                if j not in self.ready[i] and p.grad is not None:  # a gradient no hook passed on
                    view.copy_(p.grad)
                    if not self.keep_grads:
                        p.grad = None
        self._wait()
        self._count(_nbytes(shard.param))  # this rank's slice of the gradient
        self.in_flight = (i, self.optimizer.reduce_scatter(shard, self.flats[i], async_op=True))
        self.launched.add(i)

    def finish(self) -> None:
        """After backward: send the buckets backward did not complete (unused parameters), wait, average."""
        for i in range(len(self.optimizer.shards)):
            if i not in self.launched:
                self._launch(i)
        self._wait()
        self.optimizer.average()
        self.peak_bytes = self._step_peak
        self._reset()


def _nbytes(tensor) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@STRATEGIES.register
class Zero2(_ZeroMixin, Strategy):
    """Gradients reduce-scattered bucket by bucket from backward hooks, each full gradient freed once sent;
    optimizer state and gradients sharded (P_os+g)."""

    name, stage = "zero2", 2
    order, zero_stage = 50, 2  # reduce-scatter + all-gather: the all-reduce's bytes (wire_factor 2)
    refuses = ZERO_REFUSES

    def memory_breakdown(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        return {**super().memory_breakdown(model, optimizer),
                "grad_peak_bytes": self.overlap.peak_bytes if self.overlap is not None else None}
