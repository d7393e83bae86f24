"""ZeRO-3 with PyTorch's FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

Each rank keeps 1/p of every parameter. Before a block runs forward, its full parameters are
all-gathered; after, they are freed again; backward all-gathers them once more and
reduce-scatters the gradients. Per step that is two all-gathers and one reduce-scatter of the
model — about 1.5× the bytes of DDP's all-reduce — in exchange for 1/p of the model-state memory.

labkit shards each transformer block as a unit (so one block's parameters are gathered at a
time) and the root for the embeddings, and counts FSDP2's collectives through labkit's
communication layer. How much of that communication hides behind compute is not visible from
the host on CPU, so ``comm_exposed_s`` is reported as n/a.

**HSDP** (``parallel.dp.shard_degree`` s below the p ranks of the gradient axis): the mesh's data-parallel axes
are dp_replicate × dp_shard (:mod:`labkit.parallel.mesh`), and FSDP2 takes the 2-D mesh (dp_replicate,
dp_shard_cp): each block is sharded over a group of s ranks (s/cp replicas and their cp ranks; gathered,
reduce-scattered there) and each shard's gradient is all-reduced over the p/s groups — the memory of FSDP over s,
with the slow all-gathers inside a group (a node, on a cluster) and only one all-reduce of 1/s of the gradients
across groups (torchtitan's layout).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from labkit.comm.collectives import instrument_torch_collectives
from labkit.parallel.dp.base import Strategy
from labkit.parallel.dp.ddp import broadcast_from_rank0
from labkit.parallel.mesh import HSDP, context_degree
from labkit.parallel.parallelize import is_model_parallel
from labkit.parallel.spec import SAME_PARAMETERS_EVERYWHERE, STRATEGIES, refusing


@STRATEGIES.register
class FSDP2(Strategy):
    name, order = "fsdp2", 60
    zero_stage = 3  # weights, gradients and optimizer state sharded
    # it shards labkit's slices and DTensors alike, a pipeline stage as a whole model; not experts held apart (yet)
    refuses = refusing("ep", SAME_PARAMETERS_EVERYWHERE)

    @classmethod
    def wire_factor(cls, accum: int = 1) -> float:
        """An all-gather per forward and per backward of every micro-batch, one reduce-scatter."""
        return 2 * accum + 1

    exposed_comm_measurable = False
    shards_in_groups = True  # parallel.dp.shard_degree: HSDP
    shards_meta = True  # fully_shard cuts the meta model; each rank then draws its own shards (labkit.model.init)

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        found = super().problems(cfg, world)
        p, shard = cfg.parallel, cfg.parallel.dp.shard_degree
        cp = context_degree(cfg)
        replicas = world // max(1, p.tp.degree * p.pp.degree)  # dp × cp: the ranks holding the same parameters
        if p.dp.strategy == cls.name and shard > 0 and (replicas % shard or shard % cp):
            whole = " (a shard group holds whole cp groups: a multiple of cp)" if cp > 1 else ""
            found.append(f"parallel.dp.shard_degree={shard} must divide the {replicas} ranks that hold the same "
                         f"parameters (dp × cp) into shard groups{whole}; use one of "
                         f"{[d for d in range(cp, replicas + 1, cp) if replicas % d == 0]}")
        return found

    @staticmethod
    def wire_bytes(params: int, root_params: int, shard: int, replicas: int, accum: int = 1,
                   bytes_per_value: int = 4) -> float:
        """Bytes one rank sends in a step, exactly as labkit's layer counts FSDP2's collectives (ring factors):
        per micro-batch an all-gather of every unit before forward and of every block again before backward (the
        root unit — embeddings, final norm — stays gathered from its forward to its backward: FSDP2 does not
        reshard the root), one reduce-scatter of the gradients, all over the ``shard`` ranks of a shard group; with
        HSDP (``replicas`` > ``shard``) one all-reduce of each shard's gradients over the replicas. A step right
        after an evaluation sends the root's forward all-gather less (still gathered from the evaluation).
        :func:`labkit.parallel.reports.data_parallel.analytic_wire_bytes` keeps the round (2·accum + 1)·(p−1)/p·Ψ."""
        sharded = (shard - 1) / shard * bytes_per_value
        gathers = accum * (2 * params - root_params) * sharded
        groups = replicas // shard
        return gathers + params * sharded + 2 * (groups - 1) / groups * params / shard * bytes_per_value

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        broadcast_from_rank0(model, self.group, self.src)  # what is real already (tp slices)
        mesh = self.data_parallel_mesh()
        policy = MixedPrecisionPolicy()
        if self.cfg.precision.mode in ("bf16", "fp16"):
            low = torch.bfloat16 if self.cfg.precision.mode == "bf16" else torch.float16
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        replicate = [mesh.get_group(0)] if mesh.ndim == 2 else []  # HSDP's all-reduce, over dp_replicate
        self._instrumented = instrument_torch_collectives(self.comm_timer, replicate)
        self._instrumented.__enter__()
        return model

    def data_parallel_mesh(self):
        """The gradient axis of the run's device mesh (dp, × cp with context parallelism): FSDP2 shards over it —
        or, with ``parallel.dp.shard_degree`` s < its p ranks, HSDP: the 2-D mesh (dp_replicate, dp_shard_cp) of p/s
        replica groups × s ranks, and FSDP2 shards over the second and all-reduces the shards' gradients over the
        first."""
        grid = self.env.grid
        if grid.device_mesh is None:  # a grid made by hand: dp is the world
            from torch.distributed.device_mesh import init_device_mesh

            return init_device_mesh(self.env.device, (self.env.world_size,), mesh_dim_names=(self.reduces_over,))
        if grid.size("dp_replicate") == 1:
            return grid.submesh(self.reduces_over)
        return grid.submesh(HSDP)

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
        :meth:`labkit.parallel.dp.base.Strategy.full_state_dict`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload gathers onto global rank 0 alone (an empty dict elsewhere); a split model's parts are
        # gathered again over tp and pp (whole_model_state), so there every rank keeps its part's full tensors
        rank0_only = not everywhere and not is_model_parallel(self.env.grid)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
