"""Dry runs of labkit's real training code at scale, on torch's **fake** process group.

``dry_run(cfg, world, rank)`` makes this process rank ``rank`` of a world of ``world`` ranks on torch's fake
backend (``torch.testing._internal.distributed.fake_pg``: every collective returns at once and moves no data),
builds the model, the tp/pp split and the data-parallel strategy with the trainer's own set-up
(:func:`labkit.train.build_trainer`, the rank grid of :func:`labkit.parallel.mesh.build_grid`) and runs one
real training step (:meth:`labkit.train.Trainer.step`). Nothing is re-implemented, so what is recorded is what
the real code launches at that scale — context parallelism's attention included: the ring's ``isend``/``irecv``
over the cp group (the fake group's receive writes nothing: the recording zeroes the buffer), the all-gather
variant's gather and reduce-scatter, Ulysses' all-to-alls (torch's fake group copies a rank's own input into
their outputs, so no uninitialised memory reaches the step). A dry run is three pieces, one module each:

* :mod:`labkit.sim.dryrun_record` — **every collective** of the step (kind, the process group's size and
  axis, bytes and wire bytes), recorded by wrapping the real communication functions while the run lasts;
  the CommTimers' own counters are read too;
* :mod:`labkit.sim.dryrun_counts` — the **analytic counts** for the same layout, and :func:`compare`, which
  sets them beside the recording: dp (over dp × cp), tp, pp and cp bytes, and the **model-state memory of this
  rank** (what
  ``strategy.memory_breakdown`` measures from the tensors) beside the exact prediction. They must agree
  exactly;
* :mod:`labkit.sim.dryrun_report` — :func:`format_result`, all of it as plain text (``labkit sim dryrun``).

This module runs the step. Times are not measured: the fake group moves nothing, so a time would mean
nothing. The process group is destroyed at the end and every patched function restored, so a dry run leaves
no global state behind.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.sim.dryrun_counts import compare, layout_facts
from labkit.sim.dryrun_record import Recorder, axis_namer, recording
from labkit.sim.dryrun_report import format_result

__all__ = ["FAKE_LABEL", "dry_run", "dry_run_problems", "compare", "format_result"]

FAKE_LABEL = "fake process group: no data moved; bytes and memory are the real code's, times are not measured"


def dry_run_problems(cfg) -> list[str]:
    """What runs for real but not in a dry run (on the fake group), one sentence each."""
    found = []
    if cfg.parallel.pp.degree > 1 and cfg.parallel.pp.impl == "torch":
        found.append("parallel.pp.impl=torch cannot dry-run: torch.distributed.pipelining learns the shapes of a "
                     "stage's inputs by receiving a pickled object from the previous stage (recv_object_list), and "
                     "the fake process group delivers nothing (the size it reads is garbage); use "
                     "parallel.pp.impl=labkit")
    if cfg.parallel.tp.degree > 1 and cfg.parallel.tp.impl == "dtensor":
        found.append("parallel.tp.impl=dtensor is not counted by a dry run: DTensor's collectives run inside "
                     "torch (functional collectives), not through labkit's communication layer, so their bytes "
                     "are not recorded; use parallel.tp.impl=labkit")
    if cfg.comm.consistency is not None or cfg.comm.sync != "every_step":
        found.append("a dry run runs the per-step trainer: comm.consistency and comm.sync are not simulated")
    if cfg.precision.mode != "fp32" or cfg.model.freeze or cfg.comm.compression != "none":
        found.append("a dry run's analytic counts are for fp32 training of every parameter without gradient "
                     "compression: set precision.mode=fp32, model.freeze=[] and comm.compression=none")
    return found


def dry_run(cfg, world: int, rank: int = 0) -> dict:
    """One training step of rank ``rank`` of ``world`` on the fake process group; see the module docstring.

    Raises :class:`labkit.config.ConfigError` (labkit's validation, before anything starts) for a config that
    cannot run on ``world`` ranks, and ValueError for a rank outside the world. The caller's random state does
    not move (the run seeds its own, and the checks may build a corpus into an empty cache, which draws)."""
    with torch.random.fork_rng(devices=[]):
        return _checked_run(cfg, world, rank)


def _checked_run(cfg, world: int, rank: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.config import ConfigError, resolve_auto
    from labkit.validation import validate

    # labkit's validation, before anything starts: the world as ``world`` nodes of one process each (this machine
    # hosts one rank, the one simulated), so the machine checks see one process and the layout checks the world
    validate(cfg, nproc=1, nnodes=world)
    unsupported = dry_run_problems(cfg)
    if unsupported:
        raise ConfigError(unsupported)
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the world (ranks 0..{world - 1})")
    cfg, _ = resolve_auto(cfg)
    cfg = cfg.replace(**{"run.compile": "off"})  # times are not measured, and compiling moves no byte
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; a dry run needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return _run(cfg, world, rank)
    finally:
        dist.destroy_process_group()
        forget_device_meshes()


def forget_device_meshes() -> None:
    """Empty DTensor's sharding-propagation caches. They key on meshes by equality, and the next dry run in this
    process may build an equal mesh (HSDP's (8, 8) at dp 64, or at dp 32 × cp 2) on new groups: a cached answer
    would hand back a DTensor on this run's mesh, whose groups are gone."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _run(cfg, world: int, rank: int) -> dict:
    from labkit.data import build_datasets
    from labkit.distributed import DistEnv
    from labkit.model import GPTShape
    from labkit.parallel.reports.layout import predicted_rank_params
    from labkit.parallel.mesh import GRADIENT_AXIS, SHARD_AXIS, ParallelDims, build_grid
    from labkit.parallel.reports.data_parallel import predict_rank_memory
    from labkit.train import build_trainer

    torch.manual_seed(cfg.run.seed)
    dims = ParallelDims.from_config(cfg, world)
    grid = build_grid(dims, rank, "cpu")
    env = DistEnv(rank, world, 0, 1, "cpu", "fake", torch.get_num_threads(), grid)
    train_ds, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                               cfg.data.val_fraction)
    recorder = Recorder(axis_of=axis_namer(grid))
    with recording(recorder):
        trainer = build_trainer(cfg, env, train_ds, tokenizer.vocab_size)  # set-up traffic: not recorded
        try:
            recorder.recording = True
            stats = trainer.step(trainer.batches())
            recorder.recording = False
            layout = layout_facts(cfg, trainer)
        finally:
            trainer.strategy.close()
    shape = GPTShape.from_config(cfg.model, tokenizer.vocab_size, cfg.attention.backend)
    # the ZeRO paper's Ψ/p, p the ranks the strategy shards over: dp × cp, or FSDP2's shard group (HSDP)
    sharded_over = SHARD_AXIS if trainer.strategy.name == "fsdp2" else GRADIENT_AXIS
    predicted = predict_rank_memory(predicted_rank_params(shape, dims, rank), dims.size(sharded_over),
                                    trainer.strategy.name)
    counted = {"dp strategy": stats["comm_bytes"], "tensor and context parallel": stats["model_comm_bytes"] or 0,
               "pipeline": trainer.meter.pipeline_comm.bytes + (stats.get("pipeline_comm_bytes") or 0)}
    from labkit.model.moe import moe_layers
    from labkit.parallel.mesh import EXPERT_GRADIENT_AXIS

    routing = [layer.tally.kept_rows() for layer in moe_layers(trainer.model)]  # this step's, per MoE layer
    return {"world": world, "rank": rank, "mesh": dims.sizes(), "coordinate": dims.coordinate(rank),
            "routing": routing, "ep_coordinate": dims.coordinate_on(rank, "ep"),
            "expert_replicas": dims.size(EXPERT_GRADIENT_AXIS),
            "shard_coordinate": dims.coordinate_on(rank, SHARD_AXIS),
            "strategy": trainer.strategy.name, "micro_batches": trainer.accum, "cfg": cfg, "shape": shape,
            "params": predicted_rank_params(shape, dims, rank), "calls": recorder.calls,
            "counted": counted, "layout": layout, "label": FAKE_LABEL, "step_skipped": bool(stats["skipped"]),
            "memory": {"param": stats["param_bytes"], "grad": stats["grad_bytes"],
                       "optimizer": stats["optimizer_bytes"]},
            "predicted_memory": {"param": predicted.parameters, "grad": predicted.gradients,
                                 "optimizer": predicted.optimizer_state}}
