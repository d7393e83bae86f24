"""Everything a training step measures, in one object, so that the loop (``labkit.train``) only marks its phases.

The trainer calls, per step::

    meter.start(step, model, optimizer)           # the clock and timers start afresh
    with meter.phase("data"): ...                 # a slice of the step time (StepClock)
    with meter.phase("fwd_bwd"):
        with meter.forward(model): loss = ...     # forward's memory peak; once, the activations it saved
        with meter.peak("backward"): backward()
    with meter.phase("sync", memory="backward"): ...   # a slice of time and a memory phase together
    stats = {..., **meter.finish()}               # this rank's measurements (Trainer.step returns them)

and the loop, after it: ``event = meter.step_event(step, stats, facts, tally)``, every rank's measurements
gathered into the step event rank 0 writes (:func:`labkit.metrics.steps.step_event`).

What it measures:

* **time**: the step's phases on the host (:class:`~labkit.metrics.timers.StepClock`: data, fwd_bwd, sync,
  optimizer), the strategy's collectives (its ``comm_timer``: in flight and exposed), tensor and context
  parallelism's (``model_comm``: blocking, inside forward and backward, so all exposed) and the pipeline's sends
  (``pipeline_comm``; its waits are the bubble): compute is what the step spent in none of them;
* **memory**: the peak of each phase on one tracked step per attempt (:class:`~labkit.metrics.memory.PhasePeaks`,
  :func:`~labkit.metrics.memory.tracked_memory_step`; every other step reports None), the model states
  (``strategy.memory_breakdown``) and the activations forward saves for backward (counted once);
* **its own cost**: host time of the loop's measuring, by part (``bookkeeping``, in the summary and
  ``benchmarks/overhead.py``).

The gathers' collectives are handed in (``collectives``: :mod:`labkit.comm.control`, uncounted: not
training traffic); labkit.comm imports labkit.metrics, so this module cannot import it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from labkit.metrics.memory import (UNTRACKED, PhasePeaks, count_saved_bytes, held_tensors, peak_memory_bytes,
                                   tracked_memory_step)
from labkit.metrics.steps import gather_ranks, step_event, step_timeline
from labkit.metrics.timers import CommTimer, PartTimes, StepClock


@dataclass
class StepMeter:
    cfg: object
    env: object  # labkit.distributed.DistEnv: the device, the rank grid, the world
    strategy: object  # the data-parallel strategy: its comm_timer, comm_stats and memory_breakdown
    collectives: object  # sum_over_ranks and all_gather_objects for the gathers (labkit.comm.control)
    pipeline: object = None  # the pipeline schedule (parallel.pp > 1): its timeline and activations, or None
    model_comm: CommTimer = field(default_factory=CommTimer)  # tensor- and context-parallel traffic, not dp's
    pipeline_comm: CommTimer = field(default_factory=CommTimer)  # the pipeline's sends (its waits are the bubble)
    bookkeeping: PartTimes = field(default_factory=PartTimes)  # host time of the loop's own measuring
    activation_bytes: int | None = None  # what forward saves for backward, per micro-batch (measured once)
    activation_peak_bytes: int | None = None  # a pipeline stage's held activations at their peak (tracked step)
    memory_step: int | None = None  # the step whose phase peaks are tracked (set by the attempt's first step)
    peaks: object = UNTRACKED  # this step's PhasePeaks, or UNTRACKED
    started: float = 0.0  # time.perf_counter() at the step's start
    settle_steps: int = 1  # steps before memory is tracked: the attempt's first (compile=verify: its timed steps)

    def __post_init__(self):
        self.clock = StepClock(self.env.device)  # the step's phases (data, fwd_bwd, sync, optimizer)

    def start(self, step: int, model, optimizer) -> None:
        """A step begins: its memory tracked or not, the clock and the timers emptied, the time taken."""
        self.peaks = self._phase_peaks(step, model, optimizer)
        self.clock.reset()
        self.model_comm.collect()  # between steps no axis is counted (labkit.comm.axes.counting): these start empty,
        self.pipeline_comm.collect()  # and stay so should anything have been added to them by hand
        self.started = time.perf_counter()

    def timers_by_axis(self) -> dict[str, CommTimer]:
        """Which timer counts each mesh axis's traffic while a step runs (the step hands this to
        :func:`labkit.comm.axes.counting`): the strategy's gradient axes (the experts' too) on its own timer, tensor,
        context and expert parallelism on the model's, the pipeline's sends on its own."""
        gradients = self.strategy.comm_timer
        return {self.strategy.reduces_over: gradients, self.strategy.reduces_experts_over: gradients,
                "tp": self.model_comm, "cp": self.model_comm, "ep": self.model_comm, "pp": self.pipeline_comm}

    @contextmanager
    def phase(self, name: str, memory: str | None = None):
        """A slice of the step time (``name``), and with ``memory`` a memory phase whose peak is tracked."""
        with self.clock.phase(name), (self.peaks.phase(memory) if memory else nullcontext()):
            yield

    def peak(self, memory: str):
        """A memory phase alone: its peak on the tracked step (inside a timed phase)."""
        return self.peaks.phase(memory)

    @contextmanager
    def forward(self, model):
        """Forward's memory phase; once per run (the first micro-batch) the bytes it saves for backward."""
        counting = self.activation_bytes is None
        with (count_saved_bytes(model.parameters()) if counting else nullcontext()) as saved:
            with self.peaks.phase("forward"):
                yield
        if counting:
            self.activation_bytes = saved.total

    @contextmanager
    def pipeline_run(self):
        """A pipeline's forwards and backwards, interleaved by its schedule: one span, its peak reported as
        ``backward``; the stage's activations read from the schedule after it."""
        self.pipeline.memory_probe = self.peaks.current_bytes  # None but on the tracked step
        with self.phase("fwd_bwd", memory="backward"):
            yield
        self.activation_bytes = getattr(self.pipeline, "activation_bytes", None)  # one micro-batch's, on this stage
        self.activation_peak_bytes = self.pipeline.activation_peak_bytes  # read by the allocator-level tracker

    def model_states(self, model, optimizer) -> dict:
        """Parameter, gradient and optimizer-state bytes on this rank (the strategy counts what it holds)."""
        with self.bookkeeping.part("memory accounting"):
            return self.strategy.memory_breakdown(model, optimizer)

    def finish(self) -> dict:
        """The step is done: this rank's activations, phase peaks and times (``Trainer.step``'s stats).

        A tracked step reports the peak of each phase, per rank: ``forward``, ``backward`` (and the gradient
        synchronisation after it, where ZeRO-2's reduce-scatter frees the full gradients), ``optimizer``
        (clipping and the step, ZeRO's parameter all-gather included). Under pipeline parallelism the schedule
        interleaves the micro-batches' forwards and backwards, so both are one span there, reported as
        ``backward`` (``forward`` is None). Other steps report None."""
        peaks, self.peaks = self.peaks.stats(), UNTRACKED
        return {"activation_bytes": self.activation_bytes, "activation_peak_bytes": self._activation_peak(),
                **peaks, **self._timings()}

    def step_event(self, step: int, stats: dict, facts: dict, tally) -> dict:
        """Every rank's measurements on every rank (outside the timed step), as the step event; added to
        ``tally`` (:class:`labkit.metrics.steps.StepTally`, the summary's)."""
        with self.bookkeeping.part("gather"):
            ranks = gather_ranks(stats, self.env, sum_over=self.collectives.sum_over_ranks)
            # each stage's forwards and backwards, for the schedule's picture
            if stats["pipeline_timeline"] is not None:
                ranks["pipeline_timeline"] = self.collectives.all_gather_objects(stats["pipeline_timeline"])
        with self.bookkeeping.part("events"):
            tokens = self.cfg.data.batch_size * self.cfg.model.block_size
            event = step_event(step, stats["lr"], stats, ranks, tokens, facts["flops_per_token"],
                               facts["peak_tflops"], self.env)
            tally.add(event)
        return event

    def _phase_peaks(self, step: int, model, optimizer):
        """PhasePeaks for the tracked step (labkit.metrics.memory.tracked_memory_step: the first logged step
        after the attempt's first, or with ``run.compile=verify`` after its timing), else UNTRACKED."""
        if self.memory_step is None:
            self.memory_step = tracked_memory_step(step, self.cfg.metrics.log_every, self.settle_steps)
        if step != self.memory_step:
            return UNTRACKED
        return PhasePeaks(self.env.device, held_tensors(model, optimizer, self.strategy))

    def _activation_peak(self):
        """This step's reading (once: a tracked step's) of the pipeline stage's activation peak, or None."""
        peak, self.activation_peak_bytes = self.activation_peak_bytes, None
        return peak

    def _timings(self) -> dict:
        """Step time, split into data, compute and (exposed) communication, plus bytes and memory."""
        start, clock, strategy = self.started, self.clock, self.strategy
        step_time = time.perf_counter() - start
        with self.bookkeeping.part("memory accounting"):
            peak = peak_memory_bytes(self.env.device)
        with self.bookkeeping.part("step timing"):
            comm = strategy.comm_timer.collect()
            comm["comm_timing"] = strategy.comm_timer.timing  # host clock, or CUDA events
            timeline = step_timeline(start, clock.spans, comm.pop("comm_intervals"))
            comm.update(strategy.comm_stats(comm["comm_bytes"]))
            if not strategy.exposed_comm_measurable:
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
