"""ZeRO stage 3, written out (Rajbhandari et al. 2020, P_os+g+p): the parameters are sharded too.

ZeRO-1 and ZeRO-2 (:mod:`labkit.parallel.dp.zero`) shard what a rank needs only for its update: the optimizer state and
the gradients. Every rank still holds all Ψ weights, because forward and backward use all of them. Stage 3 starts
from the observation that they do not use them *at once*: a layer needs its weights only while it runs. So each
rank keeps 1/p of every weight, and borrows the rest from the other ranks for the moment a layer runs (p: the ranks
of the gradient axis, dp × cp, that hold the same parameters).

* **Units.** The model is cut into units, gathered and freed together: each transformer block, and the root (the
  embeddings, the final norm and the head tied to the token embedding: everything outside the blocks), as
  ``fsdp2`` cuts it. A unit's parameters are flattened per parameter group, padded to a multiple of p and cut into
  p equal slices (:class:`labkit.parallel.dp.zero_optimizer.FlatShard`, ZeRO-1/2's flat shards, one per unit and
  group); rank r keeps slice r of each, Ψ/p elements in all, and nothing more between uses. The model's parameters
  become views into one *full* flat buffer per shard, whose storage is emptied (``untyped_storage().resize_(0)``)
  when the unit is freed and refilled by an all-gather when it is needed: the views keep their shapes, and the views
  of them autograd saved in forward see the refilled values in backward (FSDP's trick; it works on CPU too, and the
  all-gather's writes to the buffer do not count as in-place changes of the parameters autograd saved).
* **Forward.** A forward pre-hook on each block all-gathers its slices and *starts* the next block's all-gather
  (prefetch: it travels while this block computes, and is waited for when the next block starts); a forward hook
  frees the block. The root is gathered when the model's forward starts and kept until its backward ends: its head
  runs last in forward and first in backward, so freeing it in between would only gather it again at once (FSDP2
  does not reshard its root after forward either). Evaluation (no gradients) frees the root after forward, and its
  all-gathers are counted apart from the training step's. Compute waiting for an all-gather is timed as exposed
  communication (``CommTimer.waited``), so ``comm_exposed_s`` is measured, not n/a as under ``fsdp2``.
* **Backward.** A block's weights are needed again in its backward (for the gradient of its input), so a
  full-backward pre-hook gathers the block again and starts the gather of the block before it (the last block's
  starts with the backward itself, while the head's backward runs); a full-backward hook,
  called once the gradient of the block's input is computed (the block's last use of its weights), frees it. As
  each shard's gradients become ready they are copied into one flat buffer and reduce-scattered to their owners from
  the hooks ZeRO-2 uses (:class:`labkit.parallel.dp.zero.OverlappedReduceScatter`), each full gradient freed once sent.
  Under gradient accumulation (``no_sync``) the full local gradients are summed and sent after the last micro-batch
  only, as FSDP2 does (a rank holds Ψ of gradients meanwhile).
* **Optimizer.** Each rank steps its own slices (:class:`ShardedOptimizer` at stage 3: no all-gather after the step;
  the next forward gathers what it uses); Adam's state is 1/p, and the gradient norm for clipping is one all-reduce
  of the slices' squared norms.

**Bytes per step** sent by one rank, with m micro-batches and every size the padded flat shards' (B = 4 bytes ×
elements): (p−1)/p · [Σ_blocks 2m·B_block + m·B_root + B_trainable] + the norm's one float64 all-reduce — each block
all-gathered twice per micro-batch, the root once, the gradients reduce-scattered once (frozen parameters are
gathered, never reduce-scattered). With m = 1 and a root small beside the blocks that is 3Ψ(p−1)/p, 1.5× DDP's
all-reduce: the paper's price for holding 1/p of the weights too. **Memory per rank**: the model states' 16Ψ/p
(fp32 Adam), plus the units gathered at one time — the root, the block running, the next one arriving — and the
activations.
"""
from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import collectives as comm
from labkit.metrics.timers import CommTimer
from labkit.optim import optimizer_class_and_kwargs, param_groups
from labkit.parallel.dp.base import tensor_bytes
from labkit.parallel.dp.ddp import broadcast_from_rank0
from labkit.parallel.spec import SAME_PARAMETERS_EVERYWHERE, STRATEGIES, refusing
from labkit.parallel.dp.zero import OverlappedReduceScatter, Zero2
from labkit.parallel.dp.zero_optimizer import FlatShard, ShardedOptimizer


class Unit:
    """Parameters gathered and freed together (one block, or the root): each shard's slice, and its full buffer
    holding the whole flat shard while the unit is gathered (empty storage otherwise)."""

    def __init__(self, shards: list[FlatShard], world: int):
        self.shards = shards
        self.full = [shard.flatten([p.detach() for p in shard.params], world) for shard in shards]
        for shard, full in zip(shards, self.full):
            for p, view in shard.views(full):
                p.data = view  # the parameter is now a window on the full buffer
        self.works: list = []  # all-gathers in flight
        self.gathered, self.input_needs_grad = True, True
        self.release()

    def launch(self, group) -> None:
        """Start the all-gathers of every slice into the full buffers (nothing if gathered or on its way), counted
        on whatever timer the step set for ``group``'s axis (none outside a step)."""
        if self.gathered or self.works:
            return
        for shard, full in zip(self.shards, self.full):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self.works.append(comm.all_gather(full, shard.param.detach(), group, async_op=True))

    def gather(self, group, timer: CommTimer) -> None:
        """Launch if not on its way, and wait: compute stands still meanwhile (exposed communication, on ``timer``)."""
        self.launch(group)
        if self.works:
            began = time.perf_counter()
            for work in self.works:
                work.wait()
            timer.waited(time.perf_counter() - began)
        self.works, self.gathered = [], True

    def release(self) -> None:
        """Free the full buffers (their storage, not the views: those keep their shapes, and hold nothing)."""
        for work in self.works:  # nothing is freed under a collective still writing into it
            work.wait()
        for full in self.full:
            full.untyped_storage().resize_(0)
        self.works, self.gathered = [], False


@STRATEGIES.register
class Zero3(Zero2):
    """Parameters sharded too (P_os+g+p): each unit all-gathered just before its forward and its backward, the next
    unit prefetched, gradients reduce-scattered as ready (ZeRO-2's hooks), every full unit freed after use."""

    name, stage = "zero3", 3
    order, zero_stage = 55, 3  # between zero2 and fsdp2: the same stage as fsdp2, written out
    refuses = {  # every implementation of both
        **refusing("tp", "labkit's zero3 gathers whole GPT blocks from flat slices of plain tensors; a tensor-parallel "
                         "block holds labkit's slices or DTensors, which its units are not written for (fsdp2 shards "
                         "those)"),
        **refusing("pp", "labkit's zero3 cuts the whole GPT (its blocks and the root) into units; a pipeline stage is "
                         "a part of it, run by a schedule its hooks are not written for (fsdp2 shards a stage)"),
        **refusing("ep", SAME_PARAMETERS_EVERYWHERE)}

    @classmethod
    def wire_factor(cls, accum: int = 1) -> float:
        """An all-gather per forward and per backward of every micro-batch, one reduce-scatter (FSDP2's count; the
        root, gathered once per micro-batch, sends a little less: the module docstring's exact count)."""
        return 2 * accum + 1

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        found = super().problems(cfg, world)
        if cfg.parallel.dp.strategy == cls.name and cfg.run.compile != "off":
            found.append(f"run.compile={cfg.run.compile} with parallel.dp.strategy=zero3: labkit's ZeRO-3 frees and "
                         "refills its parameters' storage from module hooks, not verified under torch.compile; set "
                         "run.compile=off, or use parallel.dp.strategy=fsdp2")
        return found

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        self.units: list[Unit] = []  # the blocks' in forward order, then the root's
        self.frozen: list[FlatShard] = []  # the slices of parameters that take no gradient (not the optimizer's)
        self.quiet = CommTimer()  # waits outside a training step (evaluation, the full state): not a step's time
        self._ending = False  # the end of the running backward is queued (_backward_starts)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place: rank 0's weights everywhere, then each unit's slices kept and the rest freed."""
        broadcast_from_rank0(model, self.group, self.src)
        owned = units_of(model)
        cls, kwargs = optimizer_class_and_kwargs(self.cfg.optim)
        groups = [{**group, "params": [p for p in group["params"] if p in mine]}  # one flat shard per unit and group
                  for mine in map(_Members, owned) for group in param_groups(model, self.cfg.optim)]
        self.optimizer = ShardedOptimizer(groups, cls, self.comm_timer, self.stage, process_group=self.group, **kwargs)
        self.overlap = OverlappedReduceScatter(self.optimizer, self.comm_timer)  # ZeRO-2's reduce-scatter hooks
        rank = dist.get_rank(self.process_group)
        for params in owned:
            mine, frozen = _Members(params), [p for p in params if not p.requires_grad]
            self.frozen += [FlatShard(frozen, rank, self.replicas)] if frozen else []  # gathered, never stepped
            shards = [s for s in [*self.optimizer.shards, *self.frozen] if s.params[0] in mine]
            self.units.append(Unit(shards, self.replicas))
        self._install_hooks(model)
        return model

    def _install_hooks(self, model: nn.Module) -> None:
        *blocks, root = self.units
        model.register_forward_pre_hook(lambda _m, _args: self._gather(root, blocks[0] if blocks else None))
        model.register_forward_hook(lambda _m, _args, out: self._root_forward_ends(root, out))
        for i, (block, unit) in enumerate(zip(model.blocks, blocks)):
            after, before = blocks[i + 1] if i + 1 < len(blocks) else None, blocks[i - 1] if i > 0 else None
            block.register_forward_pre_hook(partial(self._before_forward, unit, after))
            block.register_forward_hook(lambda _m, _args, _out, unit=unit: unit.release())
            block.register_full_backward_pre_hook(
                lambda _m, _grad, unit=unit, before=before: self._gather(unit, before))
            block.register_full_backward_hook(partial(self._after_backward, unit))

    def _gather(self, unit: Unit, prefetch: Unit | None) -> None:
        """``unit`` gathered (waited for), and ``prefetch``'s all-gather started, to be waited for when it runs. A
        forward without gradients is an evaluation's: its waits are not a training step's (nor its bytes: no step
        counts them)."""
        unit.gather(self.group, self.comm_timer if torch.is_grad_enabled() else self.quiet)
        if prefetch is not None:
            prefetch.launch(self.group)

    def _before_forward(self, unit: Unit, after: Unit | None, _module, args) -> None:
        self._gather(unit, after)
        unit.input_needs_grad = any(torch.is_tensor(a) and a.requires_grad for a in args)

    def _root_forward_ends(self, root: Unit, out) -> None:
        """Evaluation frees the root now; training keeps it for its backward, which starts with the outputs'
        gradients: a hook on them asks autograd to call :meth:`_backward_ends` once the backward is over."""
        if not torch.is_grad_enabled():
            return root.release()
        for t in out if isinstance(out, tuple) else (out,):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(self._backward_starts)

    def _backward_starts(self, _grad) -> None:
        """The backward begins with the head's: the last block, whose backward comes next, starts arriving."""
        if not self._ending:
            self._ending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
            if len(self.units) > 1:
                self.units[-2].launch(self.group)

    def _after_backward(self, unit: Unit, _module, _grad_input, _grad_output) -> None:
        # torch calls this hook before the block's backward when no input needs a gradient: the end frees it then
        if unit.input_needs_grad:
            unit.release()

    def _backward_ends(self) -> None:
        """After the whole backward: the root, and any unit still gathered or arriving, freed."""
        for unit in self.units:
            unit.release()
        self._ending = False

    def build_optimizer(self, model: nn.Module, optim_cfg) -> ShardedOptimizer:
        """The optimizer over this rank's slices, built by :meth:`wrap` (the full parameters are gone after it)."""
        return self.optimizer

    def full_state_dict(self, model: nn.Module, everywhere: bool = False) -> dict:
        """Every unit gathered in turn and copied out (on global rank 0 alone, to CPU, unless ``everywhere``), then
        freed again: no rank holds more than one gathered unit beside the copy. A collective: every rank calls it."""
        keep = everywhere or self.env.rank == 0
        copy = (lambda t: t.detach().clone()) if everywhere else (lambda t: t.detach().to("cpu", copy=True))
        entries, state = model.state_dict(keep_vars=True), {}
        for unit in self.units:
            unit.gather(self.group, self.quiet)
            mine = {id(p) for shard in unit.shards for p in shard.params}
            state.update({k: copy(v) for k, v in entries.items() if keep and id(v) in mine})
            unit.release()
        state.update({k: copy(v) for k, v in entries.items() if keep and k not in state})  # buffers: never sharded
        return {k: state[k] for k in entries} if keep else {}

    def checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        """This rank's slices of the weights (frozen ones too) and of the optimizer state, each a slice of its shard's
        whole flat tensor (:meth:`ShardedOptimizer.checkpoint_state` says why: any world size loads them); ``dcp.load``
        fills them in place. The units, and so the shards, are the model's blocks: the same at every world size."""
        slices = {str(i): optimizer.whole(s, s.param.data) for i, s in enumerate([*optimizer.shards, *self.frozen])}
        return {"model": {"flat": slices}, "optim": optimizer.checkpoint_state()}

    def load_checkpoint_state(self, model: nn.Module, optimizer: ShardedOptimizer, state: dict) -> None:
        """Nothing to put back: the slices were loaded in place, and the next forward gathers them."""

    def memory_breakdown(self, model: nn.Module, optimizer: ShardedOptimizer) -> dict:
        """ZeRO-2's count (the model's own tensors: empty between uses; the slices, their gradients, the optimizer
        state) and the frozen parameters' slices."""
        held = super().memory_breakdown(model, optimizer)
        held["param_bytes"] += tensor_bytes(s.param for s in self.frozen)
        return held

    def close(self) -> None:
        for unit in self.units:
            unit.release()  # nothing left in flight when the process group goes
        super().close()


def units_of(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each unit: every transformer block's, then the root's (the rest: embeddings, final norm, the
    head tied to the token embedding, counted once)."""
    in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
    return [*(list(block.parameters()) for block in model.blocks),
            [p for p in model.parameters() if id(p) not in in_blocks]]


class _Members:
    """Membership by identity (``p in members``): tensors compare elementwise, so a plain ``in`` would not do."""

    def __init__(self, params):
        self.ids = {id(p) for p in params}

    def __contains__(self, p) -> bool:
        return id(p) in self.ids

