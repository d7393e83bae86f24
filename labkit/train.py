"""The training loop, one worker per rank, to be read top to bottom as nanoGPT's ``train.py`` is.

1. **build** (:func:`build_trainer`): the model on the meta device and its precision, then the split over the rank
   grid in ``labkit.parallel.parallelize``'s order — pipeline stage, tensor and context parallelism, (activation
   checkpointing, inside each block), compilation, the data-parallel wrap — this rank's part made real, the
   optimizer and this replica's data;
2. **the loop** (:func:`_train`): each step (:meth:`Trainer.step`) runs forward and backward over ``accum``
   micro-batches (communicating only after the last), synchronises the gradients, clips them to the global norm
   and steps the optimizer; then its event is logged, and a checkpoint written when due.

Measurement lives elsewhere: the step only marks its phases (``with meter.phase("sync"):``) for the step meter
(:mod:`labkit.metrics.step_meter`: clock, communication timers, memory peaks, the step event); what the run is
(the ``start`` event) is :mod:`labkit.run_facts`. Events, alerts, evaluation, checkpoints and injected faults,
compile verification and the progress bar are callbacks (``labkit.callbacks``, chosen for the config by
``labkit.session.standard_callbacks``), the start-up and shutdown every worker shares is ``labkit.session``, and
the config picks strategy, precision, attention and dataset from small registries, so this file does not change
when one is added.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from labkit.callbacks import call_callbacks
from labkit.comm import control
from labkit.comm.axes import counting
from labkit.compile import VERIFY_STEPS
from labkit.config import Config, eval_micro_batches, grad_accum_steps, resolve_auto
from labkit.data import ShardedLoader, build_datasets, validation_loader
from labkit.distributed import DistEnv
from labkit.metrics.step_meter import StepMeter
from labkit.metrics.steps import StepTally
from labkit.metrics.timers import CommTimer
from labkit.model import GPT, GPTShape
from labkit.optim import lr_at, set_lr
from labkit.parallel.mesh import GRADIENT_AXIS
from labkit.parallel.parallelize import (build_pipeline_schedule, forward_backward_context, parallelize,
                                         pipeline_neighbours, sequence_part, whole_model_state)
from labkit.parallel.pp.pipeline import relay_loss
from labkit.precision import Precision, build_precision, prepare_model, scaler_state
from labkit.run_facts import finish_summary, run_facts, sent_shares, start_event
from labkit.session import WorkerSession, standard_callbacks, use_deterministic_kernels


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
    meter: StepMeter  # what the step measures (labkit.metrics.step_meter)
    step_index: int = 0  # the step step() runs next (a resume moves it)
    pipeline: object = None  # the pipeline schedule that owns the micro-batch loop (parallel.pp > 1), or None
    split_context: object = nullcontext  # around forward and backward: what a split model's loss needs
    sequence_part: object = None  # a micro-batch's tokens → this rank's part of each sequence (cp's chunks, or all)

    def __post_init__(self):
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
        listed in ``fault.skip_steps`` (dropped on purpose, to compare with what the guard does). Each
        ``meter.phase`` is a slice of the step time; ``memory=`` names the phase whose peak it also tracks.
        """
        step, meter = self.step_index, self.meter
        meter.start(step, self.model, self.optimizer)
        lr = lr_at(step, self.cfg.optim, self.cfg.run.steps)
        set_lr(self.optimizer, lr)
        with counting(meter.timers_by_axis()):  # what this step sends, each axis on its timer
            loss = self._forward_backward(iter(batches))
            with meter.phase("sync", memory="backward"):  # ZeRO-2's reduce-scatter frees the full gradients here
                self.strategy.sync_gradients(self.module)
            with meter.phase("optimizer", memory="optimizer"):
                grad_norm, skipped, scaler = self._optimizer_step(skip=step in self.cfg.fault.skip_steps)
            with meter.phase("sync"):
                self.strategy.after_optimizer_step(self.model, step)
        with meter.phase("optimizer"):
            memory = meter.model_states(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return {"lr": lr, "loss": loss, "grad_norm": grad_norm, "skipped": skipped, **scaler, **memory,
                **meter.finish()}

    def _forward_backward(self, batches) -> float:
        """Accumulate gradients over the micro-batches, communicating only after the last one."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batches)
        loss_sum, meter = 0.0, self.meter
        for micro in range(self.accum):
            with meter.phase("data"):
                x, y = self._to_device(next(batches))
            last = micro == self.accum - 1
            with meter.phase("fwd_bwd"), (nullcontext() if last else self.strategy.no_sync(self.module)), \
                    self.split_context():
                with self.precision.autocast(), meter.forward(self.model):
                    _, loss = self.module(x, y)
                loss = loss / self.accum
                scaler = self.precision.scaler
                with meter.peak("backward"):
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.item()
        return loss_sum

    def _pipeline_forward_backward(self, batches) -> float:
        """Under pipeline parallelism the schedule owns the micro-batch loop (``labkit.parallel.pp.pipeline``):
        the step's ``accum`` micro-batches go through the stages in GPipe or 1F1B order."""
        with self.meter.phase("data"):
            micro_batches = [self._to_device(next(batches)) for _ in range(self.accum)]
        with self.meter.pipeline_run():  # forward and backward interleaved: one span
            loss = self.pipeline.run(micro_batches)
        return loss

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

    @torch.no_grad()
    def evaluate(self, val_ds) -> float:
        """Mean validation loss over the same micro-batches every time, all replicas: ``run.eval_samples`` sequences
        (whatever the micro-batch size and dp), else ``run.eval_batches`` micro-batches per dp coordinate.

        Each dp coordinate scores its own shard (each cp rank its chunks of it) and the means are averaged over
        the gradient axis, dp × cp. The same tokens whatever ``run.seed`` (see :func:`labkit.data.validation_loader`).
        """
        grid = self.env.grid
        self.model.eval()
        loader = validation_loader(val_ds, self.cfg.data.micro_batch_size, grid.coord("dp"), grid.size("dp"))
        total = torch.zeros(1, dtype=torch.float64, device=self.env.torch_device)
        batches = eval_micro_batches(self.cfg.run, self.cfg.data.micro_batch_size, grid.size("dp"))
        for _ in range(batches):
            x, y = self._to_device(loader.next_micro_batch())
            with self.split_context():
                total += self._eval_loss(x, y)
        self.model.train()
        control.sum_over_ranks(total, grid.group(GRADIENT_AXIS))
        return total.item() / (batches * grid.size(GRADIENT_AXIS))

    def _eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.pipeline is None:
            with self.precision.autocast():
                return float(self.model(x, y)[1])
        return relay_loss(self.model, x, y, *pipeline_neighbours(self.env.grid), self.env.grid.group("pp"),
                          self.precision.autocast)


def build_trainer(cfg: Config, env: DistEnv, train_ds, vocab_size: int) -> Trainer:
    """Model (on the meta device) → precision → parallelized: the split over pp, tp and cp, frozen parameters,
    compiled, this rank's part made real, wrapped in the data-parallel strategy
    (``labkit.parallel.parallelize``) → the pipeline's schedule → optimizer → this replica's data."""
    shape = GPTShape.from_config(cfg.model, vocab_size, cfg.attention.backend)
    with torch.device("meta"):  # shapes only: each rank makes its own part real (labkit.model.init)
        model = GPT(shape)  # activation checkpointing (model.recompute) lives inside each block
    precision = build_precision(cfg, env.device)
    model = prepare_model(model, precision.mode)  # fp8: Linear layers → torchao Float8Linear
    model_comm, pipeline_comm = CommTimer(), CommTimer()  # tp and cp traffic; the pipeline's sends
    model, module, strategy = parallelize(model, cfg, env)
    pipeline = build_pipeline_schedule(model, cfg, env.grid, precision.autocast, strategy, module)
    meter = StepMeter(cfg, env, strategy, control, pipeline, model_comm, pipeline_comm,
                      settle_steps=VERIFY_STEPS if cfg.run.compile == "verify" else 1)
    accum = grad_accum_steps(cfg, env.world_size)
    replica, replicas = env.grid.coord("dp"), env.grid.size("dp")  # each dp coordinate reads its own shard
    loader = ShardedLoader(train_ds, cfg.data.micro_batch_size, replica, replicas, accum, cfg.run.seed)
    trainer = Trainer(cfg, env, module, model, strategy, strategy.build_optimizer(model, cfg.optim),
                      precision, loader, accum, meter, pipeline=pipeline,
                      split_context=forward_backward_context(cfg, env.grid),
                      sequence_part=sequence_part(cfg, env.grid))
    strategy.comm_timer.collect()  # set-up traffic (weights broadcast at wrap) is not a step's
    return trainer


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
    meter, parts = trainer.meter, trainer.meter.bookkeeping
    for step in range(trainer.step_index, cfg.run.steps):
        call_callbacks(callbacks, "before_step", parts, step)
        stats = trainer.step(trainer.batches())  # forward, backward, sync, clip, step: this rank's measurements
        event = meter.step_event(step, stats, facts, tally)  # every rank's, gathered: what rank 0 logs
        call_callbacks(callbacks, "after_step", parts, step, event)  # log, alerts, evaluate, checkpoint, …
        parts.count_step()
    for cb in callbacks:
        cb.on_end(summary)
    if cfg.run.save_final:
        state = trainer.strategy.full_state_dict(trainer.model)  # a collective for sharded strategies
        state = whole_model_state(state, trainer.model, cfg, env.grid)  # and for a split model
        if env.is_main:
            torch.save(state, session.run_dir / "final_model.pt")
    session.finished(**facts, bookkeeping_s_per_step=parts.per_step(), **sent_shares(trainer.strategy))
