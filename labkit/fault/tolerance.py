"""The training loop's one handle on fault management: resume, checkpoint when due, inject faults.

A callback (``labkit.callbacks``); the loop calls, in order::

    ft.on_start(trainer)                 # newest valid checkpoint: trainer.step_index moves past it
    for step in range(trainer.step_index, steps):
        ft.before_step(step)             # injected crash / hang; nan / straggler armed for this step
        trainer.step(batches)
        ft.after_step(step, event)       # checkpoint if due (+ injected corruption)
    ft.on_end(summary)                   # finish an async save in flight; restarts, checkpoints saved

Checkpoint saves, resumes and skipped checkpoints become events in ``events.jsonl``, so the
dashboard and :func:`labkit.fault.recovery.recovery_report` see them.

``fault.checkpoint_every: auto`` chooses the interval itself (:class:`AutoInterval`): it saves once after
:data:`PROBE_STEPS` steps, measuring what the save blocked the loop (δ) and the steps' time, then takes Young's
interval √(2·δ·M) for the configured mean time between failures M (``fault.mtbf_s``) in whole steps, and says so
in a ``checkpoint_interval`` event. Every rank takes the slowest rank's δ and step time, so all choose alike (a
save is collective).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from labkit.callbacks import Callback
from labkit.fault.checkpoint import Checkpointer, SaveRecord, saved_world_size
from labkit.fault.inject import FaultInjector, record_detection, restart_attempt
from labkit.fault.recovery import restore_training_state, training_state, young_daly_interval

PROBE_STEPS = 3  # checkpoint_every=auto: the steps run (and timed) before the first save measures its cost


class AutoInterval:
    """``fault.checkpoint_every: auto``: the probe save's cost and the steps' time in, the interval in steps out."""

    def __init__(self, mtbf_s: float):
        self.mtbf_s, self.step_s = mtbf_s, []

    def choose(self, save_s: float, slowest) -> dict:
        """The interval for a save that blocked ``save_s`` seconds; ``slowest`` (a tensor's in-place max over the
        ranks) makes every rank use the slowest rank's figures."""
        import statistics

        import torch

        figures = slowest(torch.tensor([save_s, statistics.median(self.step_s)], dtype=torch.float64))
        save_s, step_s = (float(x) for x in figures)
        tau = young_daly_interval(max(save_s, 1e-9), self.mtbf_s)
        steps = max(1, round(tau / step_s))
        return {"steps": steps, "interval_s": tau, "save_s": save_s, "step_s": step_s, "mtbf_s": self.mtbf_s,
                "why": f"Young: τ* = √(2·δ·M) = √(2 × {save_s:.3g} s × {self.mtbf_s:.3g} s) = {tau:.3g} s, "
                       f"{steps} steps of {step_s:.3g} s (the slowest rank's save and median step)"}


def checkpoint_directory(cfg, run_dir: str | Path) -> Path:
    return Path(cfg.fault.checkpoint_dir).expanduser() if cfg.fault.checkpoint_dir else Path(run_dir) / "checkpoints"


class FaultTolerance(Callback):
    part = "faults and checkpoints"

    def __init__(self, cfg, env, run_dir: str | Path, sink=None):
        self.cfg, self.env, self.sink = cfg, env, sink
        automatic = cfg.fault.checkpoint_every == "auto"
        self.every = 0 if automatic else cfg.fault.checkpoint_every
        self.auto = AutoInterval(cfg.fault.mtbf_s) if automatic else None
        self.anchor = -1  # the step the interval counts from (auto: the probe save's)
        self.directory = checkpoint_directory(cfg, run_dir)
        self.checkpointer: Optional[Checkpointer] = None
        if self.every or automatic:
            self.checkpointer = Checkpointer(self.directory, cfg.fault.keep_last, cfg.fault.async_save,
                                             log=self._log_invalid, on_finalized=self._log_saved)
        self.injector = FaultInjector(cfg.fault, env.rank, run_dir, self.directory, env.world_size, cfg.run.steps)
        self.armed: list = []  # this step's fault hooks on the model (removed after it)
        self.saves: list[SaveRecord] = []
        self.resumed_from: Optional[int] = None
        self.run_dir, self.watchdog = Path(run_dir), None

    def _event(self, kind: str, **fields) -> None:
        if self.sink:
            self.sink.write(kind, **fields)

    def _log_invalid(self, line: str) -> None:
        print(f"labkit: {line}", file=sys.stderr, flush=True)
        self._event("checkpoint_invalid", message=line)

    def _log_saved(self, record: SaveRecord) -> None:
        self.saves.append(record)
        self._event("checkpoint", step=record.step, blocking_s=record.blocking_s, written_s=record.written_s,
                    total_s=record.total_s,
                    bytes=record.total_bytes, path=str(record.path), async_save=self.cfg.fault.async_save)

    def resume(self, trainer) -> int:
        """Load the newest valid checkpoint (if any) and return the first step to run."""
        start, attempt, next_step, path = time.perf_counter(), restart_attempt(), 0, None
        if self.checkpointer is not None:
            restored = self.checkpointer.restore(lambda: training_state(trainer, -1))
            if restored is not None:
                path, state = restored
                next_step = restore_training_state(trainer, state)
                self.resumed_from = next_step - 1
        if attempt > 0 or path is not None:
            self._event("resume", attempt=attempt, next_step=next_step, load_s=time.perf_counter() - start,
                        checkpoint=None if path is None else str(path), world_size=self.env.world_size,
                        **self._resharding(path))
        return next_step

    def _resharding(self, path: Optional[Path]) -> dict:
        """The resume event's word on the world size: the one that saved the checkpoint, and whether it differs
        (the checkpoint was resharded onto this world: :mod:`labkit.fault.reshard`), said on stderr too."""
        saved = None if path is None else saved_world_size(path)
        resharded = saved is not None and saved != self.env.world_size
        if resharded and self.env.is_main:
            print(f"labkit: resharded {path.name}, saved by {saved} processes, onto {self.env.world_size}",
                  file=sys.stderr, flush=True)
        return {"saved_world_size": saved, "resharded": resharded}

    def on_start(self, trainer) -> None:
        self.trainer = trainer
        trainer.step_index = self.resume(trainer)
        self.first_step = trainer.step_index
        if self.cfg.fault.watchdog_s is not None:
            from labkit.fault.watchdog import Watchdog

            self.watchdog = Watchdog(self.cfg.fault.watchdog_s, self._stuck).start()

    def _stuck(self, idle_s: float) -> None:
        """The watchdog's verdict: say it, write it down, end this process (the agent restarts the group)."""
        import os

        from labkit.fault.watchdog import WATCHDOG_EXIT_CODE

        why = (f"watchdog: rank {self.env.rank} finished no step for {idle_s:.1f} s (fault.watchdog_s = "
               f"{self.cfg.fault.watchdog_s:g}); ending this attempt")
        print(f"labkit: {why}", file=sys.stderr, flush=True)
        record_detection(self.run_dir, self.env.rank, why)
        os._exit(WATCHDOG_EXIT_CODE)

    def before_step(self, step: int) -> None:
        self.injector.before_step(step)
        self.armed = self.injector.arm(self.trainer.module, step)

    def due(self, step: int) -> bool:
        return bool(self.every) and (step - self.anchor) % self.every == 0 and step < self.cfg.run.steps - 1

    def probing(self, step: int) -> bool:
        """checkpoint_every=auto, interval not chosen yet: whether ``step`` ends the probe (its save is timed)."""
        return (self.auto is not None and not self.every and step == self.first_step + PROBE_STEPS - 1
                and step < self.cfg.run.steps - 1)

    def after_step(self, step: int, event: dict) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()
        for hook in self.armed:
            hook.remove()
        self.armed = []
        if self.auto is not None and not self.every and event.get("step_time_s") is not None:
            self.auto.step_s.append(event["step_time_s"])
        if self.probing(step):
            self.choose_interval(step, self.checkpointer.save(step, training_state(self.trainer, step)))
        elif self.due(step):
            self.checkpointer.save(step, training_state(self.trainer, step))
        self.injector.after_checkpoint(step)

    def choose_interval(self, step: int, probe: SaveRecord) -> None:
        """checkpoint_every=auto: the interval from the probe save (:class:`AutoInterval`), counted from ``step``."""
        from labkit.comm import control

        chosen = self.auto.choose(probe.blocking_s, control.max_over_ranks)
        self.every, self.anchor = chosen["steps"], step
        self._event("checkpoint_interval", step=step, **chosen)
        if self.env.is_main:
            print(f"labkit: fault.checkpoint_every=auto: every {chosen['steps']} steps ({chosen['why']})",
                  file=sys.stderr, flush=True)

    def on_end(self, summary: dict) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.checkpointer is not None:
            self.checkpointer.close()  # an async save in flight finishes
        summary.update(self.summary())

    def summary(self) -> dict:
        blocking = [r.blocking_s for r in self.saves]
        return {"restarts": restart_attempt(), "resumed_from_step": self.resumed_from,
                "checkpoints_saved": len(self.saves),
                "checkpoint_blocking_s": sum(blocking) / len(blocking) if blocking else None,
                "checkpoint_bytes": self.saves[-1].total_bytes if self.saves else None}
