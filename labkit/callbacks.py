"""Everything the training loop does besides training, as callbacks called at fixed points.

The loop (``labkit.train``) reads top to bottom::

    for cb in callbacks: cb.on_start(trainer)           # may move trainer.step_index (a resume)
    for step in range(trainer.step_index, steps):
        for cb in callbacks: cb.before_step(step)
        stats = trainer.step(batches)                   # one optimizer step, nothing else
        event = meter.step_event(step, stats, ...)      # every rank's stats, gathered (labkit.metrics.step_meter)
        for cb in callbacks: cb.after_step(step, event)
    for cb in callbacks: cb.on_end(summary)             # the run finished: add to its summary
    for cb in callbacks: cb.close()                     # always, however the run ended

in the order of ``labkit.session.standard_callbacks``, which is the order things happen within a step:

==================  ===========================================  ======================================
callback            after each step                              also
==================  ===========================================  ======================================
CompileCheck        ``run.compile=verify``: time eager against   ``run.compile=on`` compiles where the
                    compiled steps, keep the faster              model is built (apply_compile)
ExpertRouting       a mixture of experts' load, max/mean and     before each step: the counts start
(model.moe)         drop rate into the event; loss-free          afresh
                    balancing moves its biases
EventLog            rank 0 writes the step event                 every ``metrics.log_every`` steps
Alerts              anomalies → alerts → a profile (layer 3)     never changes the run
Evaluation          validation loss every ``run.eval_every``     and after the last step
FaultTolerance      checkpoint when due                          resumes at start; injects faults
(labkit.fault)                                                   (crash/hang before a step, nan and
                                                                 straggler inside it through hooks)
Progress            the progress bar                             rank 0, when ``metrics.progress``
==================  ===========================================  ======================================

A callback's time is counted as bookkeeping under its ``part`` name (``StepMeter.bookkeeping``;
``benchmarks/overhead.py`` prints it), unless ``part`` is None: compilation and evaluation are work
the run asked for, not overhead. Adding a feature around the loop is one callback; the loop itself
does not change.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Optional


class Callback:
    part: Optional[str] = None  # the bookkeeping part its time counts under (None: not bookkeeping)

    def on_start(self, trainer) -> None:
        """Before the first step (after a resume, ``trainer.step_index`` says which step that is)."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, event: dict) -> None:
        pass

    def on_end(self, summary: dict) -> None:
        """The run finished: add this callback's numbers to the summary."""

    def close(self) -> None:
        """Called however the run ended (also after a failure)."""


def call_callbacks(callbacks, hook: str, parts, *args) -> None:
    """Call ``hook`` on each callback in order, its time counted under the callback's bookkeeping part
    (``parts``: a :class:`labkit.metrics.timers.PartTimes`)."""
    for cb in callbacks:
        with parts.part(cb.part) if cb.part else nullcontext():
            getattr(cb, hook)(*args)


class CompileCheck(Callback):
    """``run.compile=verify``: measures eager and compiled steps and keeps the faster (``labkit.compile``).

    (``run.compile=on`` needs no callback: the model is compiled where it is built,
    :func:`labkit.parallel.parallelize.apply_compile`.)"""

    def __init__(self, model, sink=None, summary: Optional[dict] = None):
        from labkit.compile import CompileVerifier

        self.model, self.sink = model, sink
        self.summary = {} if summary is None else summary  # the decision goes in as it is made
        self.verifier = CompileVerifier(model)

    def after_step(self, step: int, event: dict) -> None:
        decision = self.verifier.record(step, event["step_time_s"])  # this rank's own step time
        if decision:
            self.summary["compile"] = decision
            if self.sink:
                self.sink.write("compile", step=step, **decision)


class ExpertRouting(Callback):
    """A mixture of experts' router, step by step (``labkit.model.moe``), for the MoE ``layers`` of the model.

    Before each step every layer's tally starts afresh (an evaluation between steps runs in eval mode and counts
    nothing). After it, each layer's tokens per expert and dropped assignments are summed over the data-parallel
    replicas (``sum_over``: an in-place sum over the gradient axis; None with one replica) and go into the step
    event before it is logged: ``moe_load``, ``moe_max_mean``, ``moe_drop_rate``, ``moe_aux_loss``, one entry per
    layer (``moe_layers`` names their blocks). With ``balance: loss_free`` each layer's bias then moves against
    the summed load — after the optimizer step, before the next forward and before a checkpoint is written, and
    alike on every replica, since all of them move by the same sums. Under pipeline parallelism each stage holds its
    own layers, or none: ``over_stages`` (an all-gather over the pp axis) puts every stage's in the event."""

    part = "routing"

    def __init__(self, layers: list, sum_over=None, over_stages=None):
        self.layers, self.sum_over, self.over_stages = layers, sum_over, over_stages

    def before_step(self, step: int) -> None:
        for layer in self.layers:
            layer.tally.reset()

    def after_step(self, step: int, event: dict) -> None:
        from labkit.model.moe import step_event_fields, step_statistics

        counts = step_statistics(self.layers, self.sum_over)
        fields = step_event_fields(self.layers, counts)
        if self.over_stages is not None:  # a pipeline: every stage's layers (a stage may hold none), in block order
            fields = {key: [value for stage in self.over_stages(fields) for value in stage[key]] for key in fields}
        event.update(fields)
        for layer, layer_counts in zip(self.layers, counts):
            if layer.moe.balance == "loss_free":
                layer.update_bias(layer_counts[:-1])


class EventLog(Callback):
    """Rank 0 writes every ``log_every``-th step event to ``events.jsonl``."""

    part = "events"

    def __init__(self, sink, log_every: int):
        self.sink, self.log_every = sink, log_every

    def after_step(self, step: int, event: dict) -> None:
        if self.sink and step % self.log_every == 0:
            self.sink.write("step", **event)


class Alerts(Callback):
    """Layer 3 of monitoring: the watchdog judges each step (``labkit.metrics.diagnosis``)."""

    part = "watchdog"

    def __init__(self, watchdog):
        self.watchdog = watchdog

    def after_step(self, step: int, event: dict) -> None:
        self.watchdog.after_step()
        self.watchdog.observe(event)

    def on_end(self, summary: dict) -> None:
        self.watchdog.close()
        summary["alerts"] = self.watchdog.alerts


class Evaluation(Callback):
    """Validation loss every ``every`` steps and after the last one (0: never)."""

    def __init__(self, val_ds, every: int, steps: int, sink=None, summary: Optional[dict] = None):
        self.val_ds, self.every, self.steps, self.sink = val_ds, every, steps, sink
        self.summary = {} if summary is None else summary  # the latest val_loss, as it is measured

    def on_start(self, trainer) -> None:
        self.trainer = trainer

    def due(self, step: int) -> bool:
        return bool(self.every) and ((step + 1) % self.every == 0 or step == self.steps - 1)

    def after_step(self, step: int, event: dict) -> None:
        if not self.due(step):
            return
        val_loss = self.trainer.evaluate(self.val_ds)
        self.trainer.strategy.comm_timer.collect()  # evaluation traffic (FSDP2 gathers) is not a step's
        if self.sink:
            self.sink.write("eval", step=step, val_loss=val_loss)
        self.summary["val_loss"] = val_loss


class Progress(Callback):
    """A progress bar on rank 0 (tqdm): loss, tokens/s and MFU ("n/a" where undefined)."""

    part = "progress"

    def __init__(self, steps: int, description: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=steps, desc=description, unit="step", mininterval=0.5, dynamic_ncols=True)

    @staticmethod
    def wanted(metrics_cfg, is_main: bool) -> bool:
        return is_main and metrics_cfg.progress and os.environ.get("LABKIT_PROGRESS", "1") != "0"

    def on_start(self, trainer) -> None:
        self.bar.update(trainer.step_index)

    def after_step(self, step: int, event: dict) -> None:
        self.bar.set_postfix(loss=f"{event['loss']:.3f}", tok_s=f"{event['tokens_per_s']:.0f}",
                             mfu="n/a" if event["mfu"] is None else f"{event['mfu']:.1%}")
        self.bar.update(1)

    def on_end(self, summary: dict) -> None:
        self.bar.close()

