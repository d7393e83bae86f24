"""The training loop, one worker per rank. Short on purpose: every decision lives elsewhere.

Each step: for every micro-batch, forward and backward (communicating only on the last one, when
gradient accumulation is on), then one optimizer step. Around it, measurement: where the time went
(data, compute, communication), how many model FLOPs that was, and what fraction of the device's
peak (MFU). Everything else the loop does — events, alerts, evaluation, checkpoints and injected
faults, compilation, the progress bar — is a callback (``labkit.callbacks``, in their documented
order), and the start-up and shutdown every worker shares is ``labkit.session``.

Which strategy, precision, attention kernel or dataset runs is chosen by the config through
small registries (``labkit.parallel``, ``labkit.precision``, ``labkit.model.attention``,
``labkit.data``), so this file does not change when one is added.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.callbacks import Alerts, Callback, CompileCheck, Evaluation, EventLog, Progress
from labkit.comm.network import current as current_network
from labkit.compile import VERIFY_STEPS
from labkit.config import Config, grad_accum_steps, resolve_auto
from labkit.data import ShardedLoader, build_datasets, validation_floor, validation_loader
from labkit.distributed import DistEnv
from labkit.fault.recovery import recovery_report
from labkit.fault.tolerance import FaultTolerance
from labkit.hardware import device_peak
from labkit.metrics import StepClock
from labkit.metrics.events import first_event_time
from labkit.metrics.memory import (UNTRACKED, PhasePeaks, count_saved_bytes, held_tensors, memory_capacity_bytes,
                                   memory_kind, peak_memory_bytes, tracked_memory_step)
from labkit.metrics.steps import StepTally, gather_pipeline_spans, gather_ranks, step_event, step_timeline
from labkit.metrics.diagnosis import Watchdog
from labkit.metrics.timers import CommTimer, PartTimes
from labkit.model import GPT, GPTShape, count_params, flops_per_token
from labkit.optim import lr_at, set_lr
from labkit.parallel import build_strategy
from labkit.parallel.mesh import GRADIENT_AXIS
from labkit.parallel.parallelize import (apply_context_parallel, apply_pipeline, apply_rng_tracker,
                                         apply_tensor_parallel, build_pipeline_schedule, forward_backward_context,
                                         part_maker, pipeline_neighbours, sequence_part,
                                         tensor_parallel_gradient_hooks, whole_model_state)
from labkit.parallel.pp.pipeline import describe_partition, relay_loss
from labkit.precision import Precision, build_precision, prepare_model, scaler_state
from labkit.session import Stopped, WorkerSession


@dataclass
class Trainer:
    cfg: Config
    env: DistEnv
    module: torch.nn.Module  # what we call: the strategy-wrapped model
    model: torch.nn.Module  # the bare model underneath
    strategy: object
    optimizer: torch.optim.Optimizer
    precision: Precision
    loader: ShardedLoader
    accum: int
    step_index: int = 0  # the step step() runs next (a resume moves it)
    activation_bytes: int | None = None  # what forward saves for backward, per micro-batch (measured once)
    activation_peak_bytes: int | None = None  # a pipeline stage's held activations at their peak (tracked step)
    clock: StepClock = None  # the step's phases (data, fwd_bwd, sync, optimizer)
    model_comm: CommTimer = field(default_factory=CommTimer)  # tensor- and context-parallel traffic, not dp's
    pipeline_comm: CommTimer = field(default_factory=CommTimer)  # the pipeline's sends (its waits are the bubble)
    pipeline: object = None  # the pipeline schedule that owns the micro-batch loop (parallel.pp > 1), or None
    split_context: object = nullcontext  # around forward and backward: what a split model's loss needs
    sequence_part: object = None  # a micro-batch's tokens → this rank's part of each sequence (cp's chunks, or all)
    bookkeeping: PartTimes = field(default_factory=PartTimes)  # host time of the loop's own measuring
    memory_step: int | None = None  # the step whose phase peaks are tracked (set by the attempt's first step)
    peaks: object = UNTRACKED  # this step's PhasePeaks, or UNTRACKED

    def __post_init__(self):
        self.clock = self.clock or StepClock(self.env.device)
        self.sequence_part = self.sequence_part or (lambda tokens: tokens)

    def _to_device(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's (x, y) on this rank's device, cut to this rank's part of each sequence."""
        return tuple(self.sequence_part(t.to(self.env.torch_device)) for t in batch)

    def batches(self) -> Iterable:
        """This rank's micro-batches for the next step (``accum`` of them, read as the step pulls them)."""
        return self.loader.step_batches()

    def step(self, batches: Iterable) -> dict:
        """One optimizer step over ``accum`` micro-batches (x, y); returns this rank's measurements.

        A non-finite global gradient norm drops the update (a NaN is never applied), as does a step
        listed in ``fault.skip_steps`` (dropped on purpose, to compare with what the guard does).

        A tracked step (:meth:`_phase_peaks`) records the peak memory of each phase, per rank: ``forward``,
        ``backward`` (and the gradient synchronisation after it, where ZeRO-2's reduce-scatter frees the full
        gradients), ``optimizer`` (clipping and the step, ZeRO's parameter all-gather included). Under
        pipeline parallelism the schedule interleaves the micro-batches' forwards and backwards, so both are
        one span there, reported as ``backward`` (``forward`` is None). Other steps report None.
        """
        step, clock = self.step_index, self.clock
        self.peaks = self._phase_peaks()
        clock.reset()
        self.model_comm.collect()  # what ran between steps (an evaluation's) is not this step's
        self.pipeline_comm.collect()
        start = time.perf_counter()
        lr = lr_at(step, self.cfg.optim, self.cfg.run.steps)
        set_lr(self.optimizer, lr)
        loss = self._forward_backward(iter(batches))
        with clock.phase("sync"), self.peaks.phase("backward"):
            self.strategy.sync_gradients(self.module)
        with clock.phase("optimizer"), self.peaks.phase("optimizer"):
            grad_norm, skipped, scaler = self._optimizer_step(skip=step in self.cfg.fault.skip_steps)
        with clock.phase("sync"):
            self.strategy.after_optimizer_step(self.model, step)
        with clock.phase("optimizer"):
            with self.bookkeeping.part("memory accounting"):
                memory = self.strategy.memory_breakdown(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        peaks, self.peaks = self.peaks.stats(), UNTRACKED
        return {"lr": lr, "loss": loss, "grad_norm": grad_norm, "skipped": skipped, **scaler, **memory,
                "activation_bytes": self.activation_bytes, "activation_peak_bytes": self._activation_peak(),
                **peaks, **self._timings(start, clock)}

    def _activation_peak(self):
        """This step's reading (once: a tracked step's) of the pipeline stage's activation peak, or None."""
        peak, self.activation_peak_bytes = self.activation_peak_bytes, None
        return peak

    def _phase_peaks(self):
        """PhasePeaks for the tracked step (labkit.metrics.memory.tracked_memory_step: the first logged step
        after the attempt's first, or with ``run.compile=verify`` after its timing), else UNTRACKED."""
        if self.memory_step is None:
            after = VERIFY_STEPS if self.cfg.run.compile == "verify" else 1
            self.memory_step = tracked_memory_step(self.step_index, self.cfg.metrics.log_every, after)
        if self.step_index != self.memory_step:
            return UNTRACKED
        return PhasePeaks(self.env.device, held_tensors(self.model, self.optimizer, self.strategy))

    def _forward_backward(self, batches) -> float:
        """Accumulate gradients over the micro-batches, communicating only after the last one."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batches)
        loss_sum, clock = 0.0, self.clock
        for micro in range(self.accum):
            with clock.phase("data"):
                x, y = self._to_device(next(batches))
            last = micro == self.accum - 1
            counting = self.activation_bytes is None  # once: the first micro-batch of the run
            with clock.phase("fwd_bwd"), (nullcontext() if last else self.strategy.no_sync(self.module)), \
                    self.split_context():
                with self.precision.autocast(), \
                        (count_saved_bytes(self.model.parameters()) if counting else nullcontext()) as saved:
                    with self.peaks.phase("forward"):
                        _, loss = self.module(x, y)
                if counting:
                    self.activation_bytes = saved.total
                loss = loss / self.accum
                scaler = self.precision.scaler
                with self.peaks.phase("backward"):
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.item()
        return loss_sum

    def _pipeline_forward_backward(self, batches) -> float:
        """Under pipeline parallelism the schedule owns the micro-batch loop (``labkit.parallel.pp.pipeline``):
        the step's ``accum`` micro-batches go through the stages in GPipe or 1F1B order."""
        with self.clock.phase("data"):
            micro_batches = [self._to_device(next(batches)) for _ in range(self.accum)]
        self.pipeline.memory_probe = self.peaks.current_bytes  # None but on the tracked step
        with self.clock.phase("fwd_bwd"), self.peaks.phase("backward"):  # forward and backward interleaved
            loss = self.pipeline.run(micro_batches)
        self.activation_bytes = getattr(self.pipeline, "activation_bytes", None)  # one micro-batch's, on this stage
        self.activation_peak_bytes = self.pipeline.activation_peak_bytes  # read by the allocator-level tracker
        return loss

    def _pipeline_stats(self, start: float) -> dict:
        """Where this stage's forwards and backwards ran in the step, and its idle share (its view of the bubble)."""
        if not getattr(self.pipeline, "timeline", None):  # no pipeline (or torch's interleaved: its chunks untimed)
            return {"pipeline_idle": 0.0, "pipeline_idle_s": 0.0, "pipeline_in_flight": None, "pipeline_spans": {},
                    "pipeline_timeline": None}
        timeline = self.pipeline.timeline
        spans = [(s["kind"], s["start"], s["end"]) for s in timeline]
        return {"pipeline_idle": getattr(self.pipeline, "idle_share", 0.0),
                "pipeline_idle_s": getattr(self.pipeline, "idle_s", 0.0),
                "pipeline_in_flight": getattr(self.pipeline, "max_in_flight", None),
                "pipeline_spans": step_timeline(start, spans, []),
                # relative to this rank's step start; step_start (time.perf_counter, one clock for every process of
                # a machine) lines the ranks up on one machine
                "pipeline_timeline": {"step_start": start, "spans": [
                    {**s, "start": round(s["start"] - start, 6), "end": round(s["end"] - start, 6),
                     "wait": round(s["wait"], 6), "cpu": round(s["cpu"], 6)} for s in timeline]}}

    def _optimizer_step(self, skip: bool = False) -> tuple[float, bool, dict]:
        """Clip to the global gradient norm and step (through the fp16 loss scaler if there is one).

        Returns the norm, whether the update was dropped, and the scaler's ``loss_scale`` and
        ``overflow`` (the scaler lowered its scale: this step's gradients held an inf or NaN and it
        skipped the update). The norm is global (all ranks agree), so when one rank's gradients are
        NaN every rank drops the same update.
        """
        scaler, clip = self.precision.scaler, self.cfg.optim.grad_clip
        scale_before = float(scaler.get_scale()) if scaler else None
        if scaler:
            scaler.unscale_(self.optimizer)
        grad_norm = float(self.strategy.clip_grad_norm(self.model, self.optimizer, clip if clip > 0 else float("inf")))
        skipped = skip or not math.isfinite(grad_norm)
        if scaler:  # the scaler drops a non-finite step itself, and lowers its scale
            if not skip:
                scaler.step(self.optimizer)
            scaler.update()
        elif not skipped:
            self.optimizer.step()
        return grad_norm, skipped, scaler_state(scaler, scale_before)

    def _timings(self, start: float, clock: StepClock) -> dict:
        """Step time, split into data, compute and (exposed) communication, plus bytes and memory."""
        step_time = time.perf_counter() - start
        with self.bookkeeping.part("memory accounting"):
            peak = peak_memory_bytes(self.env.device)
        with self.bookkeeping.part("step timing"):
            comm = self.strategy.comm_timer.collect()
            comm["comm_timing"] = self.strategy.comm_timer.timing  # host clock, or CUDA events
            timeline = step_timeline(start, clock.spans, comm.pop("comm_intervals"))
            comm.update(self.strategy.comm_stats(comm["comm_bytes"]))
            if not self.strategy.exposed_comm_measurable:
                comm["comm_exposed_s"] = None
            model_comm = self.model_comm.collect()  # blocking, inside forward and backward: all exposed
            if self.cfg.parallel.tp.degree > 1 and self.cfg.parallel.tp.impl == "dtensor":
                model_comm.update(comm_s=None, comm_bytes=None, comm_calls=None)  # inside DTensor: not counted
            timeline["model_comm"] = step_timeline(start, [], model_comm.pop("comm_intervals"))["comm"]
            pipeline = self._pipeline_stats(start)
            timeline.update({k: v for k, v in pipeline.pop("pipeline_spans").items() if k != "comm"})
            exposed = comm["comm_exposed_s"]
            p2p = self.pipeline_comm.collect()
            idle = pipeline["pipeline_idle_s"]
            compute = (None if exposed is None else max(0.0, step_time - clock.totals["data"] - exposed
                                                         - (model_comm["comm_s"] or 0.0) - idle))
        return {"step_time_s": step_time, "data_s": clock.totals["data"], "compute_s": compute, **comm,
                "model_comm_s": model_comm["comm_s"], "model_comm_bytes": model_comm["comm_bytes"],
                "model_comm_calls": model_comm["comm_calls"], **pipeline,
                # torch's pipeline sends inside its own schedule: labkit counts only the tied sum and the loss there
                "pipeline_comm_bytes": p2p["comm_bytes"] if hasattr(self.pipeline, "p2p_bytes") else None,
                "max_mem_bytes": peak, "timeline": timeline}

    @torch.no_grad()
    def evaluate(self, val_ds) -> float:
        """Mean validation loss over the same ``eval_batches`` micro-batches every time, all replicas.

        Each dp coordinate scores its own shard (each cp rank its chunks of it) and the means are averaged over
        the gradient axis, dp × cp. The same tokens whatever ``run.seed`` (see :func:`labkit.data.validation_loader`).
        """
        grid = self.env.grid
        self.model.eval()
        loader = validation_loader(val_ds, self.cfg.data.micro_batch_size, grid.coord("dp"), grid.size("dp"))
        total = torch.zeros(1, dtype=torch.float64, device=self.env.torch_device)
        for _ in range(self.cfg.run.eval_batches):
            x, y = self._to_device(loader.next_micro_batch())
            with self.split_context():
                total += self._eval_loss(x, y)
        self.model.train()
        dist.all_reduce(total, group=grid.group(GRADIENT_AXIS))
        return total.item() / (self.cfg.run.eval_batches * grid.size(GRADIENT_AXIS))

    def _eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.pipeline is None:
            with self.precision.autocast():
                return float(self.model(x, y)[1])
        return relay_loss(self.model, x, y, *pipeline_neighbours(self.env.grid), self.env.grid.group("pp"),
                          self.precision.autocast)



def build_trainer(cfg: Config, env: DistEnv, train_ds, vocab_size: int) -> Trainer:
    """Model (on the meta device) → precision → the split over pp, tp and cp → frozen parameters → this rank's
    part made real → data-parallel strategy → optimizer → this replica's data (the order of
    ``labkit.parallel.parallelize``)."""
    shape = GPTShape.from_config(cfg.model, vocab_size, cfg.attention.backend)
    with torch.device("meta"):  # shapes only: each rank makes its own part real (labkit.model.init)
        model = GPT(shape)
    precision = build_precision(cfg, env.device)
    model = prepare_model(model, precision.mode)  # fp8: Linear layers → torchao Float8Linear
    model_comm, pipeline_comm = CommTimer(), CommTimer()
    model = apply_pipeline(model, env.grid)
    make_real = part_maker(model, cfg.run.seed, env.torch_device)
    model = apply_tensor_parallel(model, cfg, env.grid, model_comm, make_real)
    model = apply_context_parallel(model, cfg, env.grid, model_comm, env.torch_device)
    model = apply_rng_tracker(model, cfg, env.grid, env.torch_device)
    freeze(model, cfg.model.freeze)
    strategy = build_strategy(cfg, env)
    split_hooks = tensor_parallel_gradient_hooks(model, cfg, env.grid, model_comm)  # before wrap: FSDP2 swaps params
    if not strategy.shards_meta:
        make_real(model)
    module = strategy.wrap(model)
    make_real(model)  # FSDP2: this rank's shards
    strategy.gradient_hooks += split_hooks
    pipeline = build_pipeline_schedule(model, cfg, env.grid, pipeline_comm, precision.autocast, strategy, module)
    accum = grad_accum_steps(cfg, env.world_size)
    replica, replicas = env.grid.coord("dp"), env.grid.size("dp")  # each dp coordinate reads its own shard
    loader = ShardedLoader(train_ds, cfg.data.micro_batch_size, replica, replicas, accum, cfg.run.seed)
    trainer = Trainer(cfg, env, module, model, strategy, strategy.build_optimizer(model, cfg.optim),
                      precision, loader, accum, model_comm=model_comm, pipeline_comm=pipeline_comm, pipeline=pipeline,
                      split_context=forward_backward_context(cfg, env.grid),
                      sequence_part=sequence_part(cfg, env.grid))
    strategy.comm_timer.collect()  # set-up traffic (weights broadcast at wrap) is not a step's
    return trainer


def freeze(model: torch.nn.Module, prefixes: list[str]) -> None:
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            p.requires_grad_(False)


def attention_kernel(cfg: Config, shape: GPTShape, env: DistEnv, precision: Precision) -> str:
    """The attention kernel that runs for this model's micro-batches (sdpa picks one per shape and dtype)."""
    from labkit.model.attention import describe_kernel

    cp = cfg.parallel.cp
    if env.grid.size("cp") > 1:  # the backend does not run: attention is computed block by block over the cp group
        return f"context-parallel {cp.impl} over cp={cp.degree}, {cp.layout} chunks (labkit.parallel.cp)"

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision.mode, torch.float32)
    q = torch.zeros(cfg.data.micro_batch_size, shape.n_head, shape.block_size, shape.n_embd // shape.n_head,
                    dtype=dtype, device=env.torch_device)
    return describe_kernel(cfg.attention.backend, q)


def shared_peak(cfg: Config, env: DistEnv, precision: Precision) -> dict:
    """Rank 0 finds the per-device peak (measuring it once on CPU); every rank gets the same."""
    box = [device_peak(env.device, precision.peak_dtype, env.threads, cfg.metrics.peak_tflops)
           if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_facts(cfg: Config, env: DistEnv, trainer: Trainer, val_ds, meta, auto: dict) -> dict:
    """What the run is (model size, FLOPs per token, the peak behind MFU, loss floors, kernels), for
    the start event and the summary; rank 0 measures the validation floor."""
    shape, precision = trainer.model.shape, trainer.precision
    peak = shared_peak(cfg, env, precision)
    val_floor = (validation_floor(cfg.data.dataset, val_ds, cfg.data.val_fraction, cfg.data.micro_batch_size,
                                  trainer.loader.world_size, cfg.run.eval_batches)
                 if env.is_main and val_ds is not None else None)
    return {"params": count_params(shape), "flops_per_token": flops_per_token(shape),
            "peak_tflops": peak["tflops"], "peak_source": peak["source"],
            "entropy_floor": (meta or {}).get("entropy_nats_per_token"), "val_floor": val_floor,
            "attention_kernel": attention_kernel(cfg, shape, env, precision), "strategy": trainer.strategy.name,
            "pipeline_partition": describe_partition(shape, env.grid.size("pp")) if env.grid.size("pp") > 1 else None,
            "auto": auto}


def start_event(cfg: Config, env: DistEnv, trainer: Trainer, facts: dict) -> dict:
    return {**facts, "world_size": env.world_size, "mesh": env.grid.dims.sizes(), "backend": env.backend,
            "device": env.device, "threads_per_proc": env.threads, "grad_accum": trainer.accum,
            "memory_kind": memory_kind(env.device),
            "memory_capacity_bytes": memory_capacity_bytes(env.device, env.local_rank, env.local_world_size),
            "dataset": cfg.data.dataset, "vocab_size": trainer.model.shape.vocab_size, "steps": cfg.run.steps,
            "gpu_name": torch.cuda.get_device_name(env.local_rank) if env.device == "cuda" else None,
            "network": current_network().describe()}


def finish_summary(summary: dict, tally: StepTally, env: DistEnv, run_dir: Path, t0: float) -> None:
    """Rank 0's closing numbers; ``tally`` holds this attempt's steps (a resumed run's since its resume)."""
    if (run_dir / "faults.jsonl").exists():
        summary["faults"] = recovery_report(run_dir)
    started = first_event_time(run_dir / "events.jsonl", default=t0)  # the first attempt's start
    last = tally.last
    summary.update(steps_completed=last["step"] + 1 if last else summary.get("resumed_from_step") or 0,
                   world_size=env.world_size, backend=env.backend, device=env.device,
                   wall_time_s=time.time() - started, final_loss=last["loss"] if last else None,
                   max_mem_bytes=tally.max_mem_bytes, overflow_steps=tally.overflows, **tally.means())


def use_deterministic_kernels() -> None:
    """Deterministic kernels, so that a rerun is bit-for-bit the same, without NaN-filling new tensors.

    torch's deterministic mode also fills every uninitialised tensor (``torch.empty``) with NaN by
    default, so that code reading memory it never wrote fails loudly: a debugging aid that changes no
    correct result but writes every new activation buffer once more in each step (``aten::fill_`` in a
    profile of the step; ``benchmarks/overhead.py`` measures the loop against a bare one).
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def train(cfg: Config, run_dir: str | Path) -> dict | None:
    """Run one worker's training; rank 0 returns the summary (others return None)."""
    if cfg.comm.consistency is not None:  # the CAP lab: sync / local SGD / SSP / async, on the same processes
        from labkit.consistency import train_consistency

        return train_consistency(cfg, run_dir)
    with WorkerSession(cfg, run_dir) as session:
        _train(session)  # everything holding communication state lives in its frame, gone before shutdown
    return session.result()


def _train(session: WorkerSession) -> None:
    cfg, auto = resolve_auto(session.cfg)
    env, sink, summary = session.env, session.sink, session.summary
    torch.manual_seed(cfg.run.seed)
    use_deterministic_kernels()
    tally = StepTally()
    session.finishers.append(lambda s: finish_summary(s, tally, env, session.run_dir, session.t0))
    train_ds, val_ds, tokenizer, meta = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                                       cfg.data.val_fraction)
    trainer = build_trainer(cfg, env, train_ds, tokenizer.vocab_size)
    session.closers.append(trainer.strategy.close)
    facts = run_facts(cfg, env, trainer, val_ds, meta, auto)
    if sink:
        sink.write("start", **start_event(cfg, env, trainer, facts))
    callbacks = standard_callbacks(cfg, env, session.run_dir, sink, val_ds, trainer.model, summary)
    session.closers += [cb.close for cb in callbacks]
    for cb in callbacks:
        cb.on_start(trainer)
    tokens, parts = cfg.data.batch_size * cfg.model.block_size, trainer.bookkeeping
    for step in range(trainer.step_index, cfg.run.steps):
        call_callbacks(callbacks, "before_step", parts, step)
        stats = trainer.step(trainer.batches())
        with parts.part("gather"):
            ranks = gather_ranks(stats, env)
            # each stage's forwards and backwards, for the schedule's picture
            if stats["pipeline_timeline"] is not None:
                ranks["pipeline_timeline"] = gather_pipeline_spans(stats["pipeline_timeline"], env)
        with parts.part("events"):
            event = step_event(step, stats["lr"], stats, ranks, tokens, facts["flops_per_token"],
                               facts["peak_tflops"], env)
            tally.add(event)
        call_callbacks(callbacks, "after_step", parts, step, event)
        parts.count_step()
    for cb in callbacks:
        cb.on_end(summary)
    if cfg.run.save_final:
        state = trainer.strategy.full_state_dict(trainer.model)  # a collective for sharded strategies
        state = whole_model_state(state, trainer.model, cfg, env.grid)  # and for a split model
        if env.is_main:
            torch.save(state, session.run_dir / "final_model.pt")
    session.finished(**facts, bookkeeping_s_per_step=parts.per_step())
    compressor = trainer.strategy.compressor
    if compressor is not None and compressor.sent_shares():
        summary["sent_shares"] = compressor.sent_shares()  # rank 0's: where a sparsifier's bytes went


def standard_callbacks(cfg, env, run_dir, sink, val_ds, model, summary: dict) -> list[Callback]:
    """The loop's callbacks for ``cfg``, in the order they run (see the table above).

    ``summary`` is the run's summary: a compile decision and the latest validation loss go in as they
    are measured, so a run that fails later keeps them; the others add theirs when the run finishes.
    """
    callbacks: list[Callback] = []
    if cfg.run.compile != "off":
        callbacks.append(CompileCheck(cfg.run.compile, model, sink, summary))
    callbacks.append(EventLog(sink, cfg.metrics.log_every))
    if cfg.metrics.alerts:
        callbacks.append(Alerts(Watchdog(cfg.metrics, env, run_dir, sink)))
    callbacks.append(Evaluation(val_ds, cfg.run.eval_every, cfg.run.steps, sink, summary))
    callbacks.append(FaultTolerance(cfg, env, run_dir, sink))
    if Progress.wanted(cfg.metrics, env.is_main):
        callbacks.append(Progress(cfg.run.steps, f"train ×{env.world_size} {env.backend}"))
    return callbacks


def call_callbacks(callbacks, hook: str, parts: PartTimes, *args) -> None:
    """Call ``hook`` on each callback in order, its time counted under the callback's bookkeeping part."""
    for cb in callbacks:
        with parts.part(cb.part) if cb.part else nullcontext():
            getattr(cb, hook)(*args)


def _raise_stopped(signum, frame):
    raise Stopped(f"signal {signum}")


@record  # a failure's message goes to the elastic agent's error file: the run's summary can say why
def worker_main(cfg: Config, run_dir: str | Path) -> int:
    """Entry point of one worker process (under torchrun or labkit's launcher), given its parsed config."""
    from labkit.launcher import exit_when_orphaned, remove_pid_file, write_pid_file

    signal.signal(signal.SIGTERM, _raise_stopped)
    exit_when_orphaned()
    run_dir = Path(run_dir)
    pid_file = write_pid_file(run_dir / "pids", os.environ.get("RANK", "0"))  # pid and start time
    code = 0
    try:
        train(cfg, run_dir)
    except Stopped:
        code = 143
    finally:
        remove_pid_file(pid_file)
    # Everything is written and closed. Leave without running C++ static destructors, which can
    # race with the communication backend's threads and abort a process that finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
