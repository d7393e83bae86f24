"""ZeRO-3 with PyTorch's FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

Each rank keeps 1/p of every parameter. Before a block runs forward, its full parameters are
all-gathered; after, they are freed again; backward all-gathers them once more and
reduce-scatters the gradients. Per step that is two all-gathers and one reduce-scatter of the
model — about 1.5× the bytes of DDP's all-reduce — in exchange for 1/p of the model-state memory.

labkit shards each transformer block as a unit (so one block's parameters are gathered at a
time) and the root for the embeddings, and counts FSDP2's collectives through labkit's
communication layer. How much of that communication hides behind compute is not visible from
the host on CPU, so ``comm_exposed_s`` is reported as n/a.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from labkit.comm.collectives import instrument_torch_collectives
from labkit.parallel.base import Strategy
from labkit.parallel.ddp import broadcast_from_rank0
from labkit.parallel.mesh import GRADIENT_AXIS
from labkit.parallel.parallelize import is_model_parallel
from labkit.parallel.spec import STRATEGIES


@STRATEGIES.register
class FSDP2(Strategy):
    name, order = "fsdp2", 60
    zero_stage = 3  # weights, gradients and optimizer state sharded
    model_parallel = {"tp": ("labkit", "dtensor"), "pp": ("labkit", "torch")}

    @classmethod
    def wire_factor(cls, accum: int = 1) -> float:
        """An all-gather per forward and per backward of every micro-batch, one reduce-scatter."""
        return 2 * accum + 1

    exposed_comm_measurable = False
    shards_meta = True  # fully_shard cuts the meta model; each rank then draws its own shards (labkit.model.init)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        broadcast_from_rank0(model, self.comm_timer, self.group, self.src)  # what is real already (tp slices)
        mesh = self.data_parallel_mesh()
        policy = MixedPrecisionPolicy()
        if self.cfg.precision.mode in ("bf16", "fp16"):
            low = torch.bfloat16 if self.cfg.precision.mode == "bf16" else torch.float16
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self._instrumented = instrument_torch_collectives(self.comm_timer)
        self._instrumented.__enter__()
        return model

    def data_parallel_mesh(self):
        """The gradient axis of the run's device mesh (dp, × cp with context parallelism): FSDP2 shards over it."""
        if self.env.grid.device_mesh is not None:
            return self.env.grid.submesh(GRADIENT_AXIS)
        from torch.distributed.device_mesh import init_device_mesh  # a grid made by hand: dp is the world

        return init_device_mesh(self.env.device, (self.env.world_size,))

    def close(self) -> None:
        if getattr(self, "_instrumented", None) is not None:
            self._instrumented.__exit__(None, None, None)
            self._instrumented = None

    @contextmanager
    def _no_sync(self, module: nn.Module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(self, module: nn.Module):
        return self._no_sync(module)

    def sync_gradients(self, module: nn.Module) -> None:
        self.comm_timer.backward_done()
        self.run_gradient_hooks()  # on each rank's slices: FSDP reduce-scattered them in backward

    def clip_grad_norm(self, model: nn.Module, optimizer, max_norm: float) -> float:
        if is_model_parallel(self.env.grid):
            return super().clip_grad_norm(model, optimizer, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model: nn.Module, everywhere: bool = False) -> dict:
        """Every parameter all-gathered whole (torch's ``get_model_state_dict``); where it lands:
        :meth:`labkit.parallel.base.Strategy.full_state_dict`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload gathers onto global rank 0 alone (an empty dict elsewhere); a split model's parts are
        # gathered again over tp and pp (whole_model_state), so there every rank keeps its part's full tensors
        rank0_only = not everywhere and not is_model_parallel(self.env.grid)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
