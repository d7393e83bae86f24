"""What a run is, found once at its start, and what it did, counted at its end.

At the start (:func:`run_facts`, :func:`start_event`): the model's size and FLOPs per token, the device's peak
behind MFU (rank 0 measures it once, every rank gets the same), the loss floors, the attention kernel that runs,
the strategy, the pipeline's partition, the rank grid and the hardware — the ``start`` event, and the summary's
facts. At the end (:func:`finish_summary`): the summary's closing numbers from the attempt's steps; and, when the
run finished, where a sparsifier's bytes went (:func:`sent_shares`).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from labkit.config import eval_micro_batches
from labkit.comm.control import broadcast_object
from labkit.comm.network import current as current_network
from labkit.data import validation_floor
from labkit.fault.recovery import recovery_report
from labkit.hardware import device_peak
from labkit.metrics.events import first_event_time
from labkit.metrics.memory import memory_capacity_bytes, memory_kind
from labkit.metrics.steps import StepTally
from labkit.model import GPTShape, count_params, flops_per_token
from labkit.parallel.pp.pipeline import describe_partition


def attention_kernel(cfg, shape: GPTShape, env, precision) -> str:
    """The attention kernel that runs for this model's micro-batches (sdpa picks one per shape and dtype)."""
    from labkit.model.attention import describe_kernel

    cp = cfg.parallel.cp
    if env.grid.size("cp") > 1:  # the backend does not run: attention is computed block by block over the cp group
        return f"context-parallel {cp.impl} over cp={cp.degree}, {cp.layout} chunks (labkit.parallel.cp)"

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision.mode, torch.float32)
    q = torch.zeros(cfg.data.micro_batch_size, shape.n_head, shape.block_size, shape.n_embd // shape.n_head,
                    dtype=dtype, device=env.torch_device)
    return describe_kernel(cfg.attention.backend, q)


def shared_peak(cfg, env, precision) -> dict:
    """Rank 0 finds the per-device peak (measuring it once on CPU); every rank gets the same."""
    mine = device_peak(env.device, precision.peak_dtype, env.threads, cfg.metrics.peak_tflops) if env.is_main else None
    return broadcast_object(mine, src=0)


def run_facts(cfg, env, trainer, val_ds, meta, auto: dict) -> dict:
    """What the run is (model size, FLOPs per token, the peak behind MFU, loss floors, kernels), for
    the start event and the summary; rank 0 measures the validation floor."""
    shape, precision = trainer.model.shape, trainer.precision
    peak = shared_peak(cfg, env, precision)
    val_floor = (validation_floor(cfg.data.dataset, val_ds, cfg.data.val_fraction, cfg.data.micro_batch_size,
                                  trainer.loader.world_size,
                                  eval_micro_batches(cfg.run, cfg.data.micro_batch_size, trainer.loader.world_size))
                 if env.is_main and val_ds is not None else None)
    return {"params": count_params(shape), "flops_per_token": flops_per_token(shape),
            "peak_tflops": peak["tflops"], "peak_source": peak["source"],
            "entropy_floor": (meta or {}).get("entropy_nats_per_token"), "val_floor": val_floor,
            "attention_kernel": attention_kernel(cfg, shape, env, precision), "strategy": trainer.strategy.name,
            "pipeline_partition": describe_partition(shape, env.grid.size("pp")) if env.grid.size("pp") > 1 else None,
            "auto": auto}


def start_event(cfg, env, trainer, facts: dict) -> dict:
    """The ``start`` event's fields: the facts, the rank grid, the machine, the data."""
    return {**facts, "world_size": env.world_size, "mesh": env.grid.dims.sizes(), "backend": env.backend,
            "device": env.device, "threads_per_proc": env.threads, "grad_accum": trainer.accum,
            "memory_kind": memory_kind(env.device),
            "memory_capacity_bytes": memory_capacity_bytes(env.device, env.local_rank, env.local_world_size),
            "dataset": cfg.data.dataset, "vocab_size": trainer.model.shape.vocab_size, "steps": cfg.run.steps,
            "gpu_name": torch.cuda.get_device_name(env.local_rank) if env.device == "cuda" else None,
            "network": current_network().describe()}


def finish_summary(summary: dict, tally: StepTally, env, run_dir: Path, t0: float) -> None:
    """Rank 0's closing numbers; ``tally`` holds this attempt's steps (a resumed run's since its resume)."""
    if (run_dir / "faults.jsonl").exists():
        summary["faults"] = recovery_report(run_dir)
    started = first_event_time(run_dir / "events.jsonl", default=t0)  # the first attempt's start
    last = tally.last
    summary.update(steps_completed=last["step"] + 1 if last else summary.get("resumed_from_step") or 0,
                   world_size=env.world_size, backend=env.backend, device=env.device,
                   wall_time_s=time.time() - started, final_loss=last["loss"] if last else None,
                   max_mem_bytes=tally.max_mem_bytes, overflow_steps=tally.overflows, **tally.means())


def sent_shares(strategy) -> dict:
    """``{"sent_shares": ...}`` for the summary of a run whose gradients a sparsifier compressed: per parameter,
    the fraction of its entries this rank sent per step (rank 0's, in the summary); empty otherwise."""
    compressor = strategy.compressor
    shares = compressor.sent_shares() if compressor is not None else None
    return {"sent_shares": shares} if shares else {}
