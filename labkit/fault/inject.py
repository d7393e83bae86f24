"""Fault injection: real failures, on purpose, at a chosen rank and step (config ``fault.inject``).

=====================  =====================================================  ===================
kind                   what happens on rank ``inject_rank`` at ``inject_step``  recovered by
=====================  =====================================================  ===================
``crash``              the process exits at once (as a segfault or OOM kill)  elastic restart
``kill``               SIGKILL from outside (``Run.kill_rank`` / ``labkit      elastic restart
                       kill``), not from this module
``hang``               the rank stops participating: it sleeps forever         collective timeout
                                                                               → restart
``straggler``          the rank's compute takes ``straggler_ms`` longer every  nothing to recover:
                       step from then on (a slow node stays slow)             visible in metrics
``nan``                the rank's loss, hence its gradients, become NaN        the step is skipped
``corrupt_checkpoint`` after that step's checkpoint, one byte of the newest   manifest check →
                       checkpoint is flipped and the rank crashes             previous checkpoint
=====================  =====================================================  ===================

Every fault is written to ``RUN_DIR/faults.jsonl`` *before* it happens, with a timestamp and its place in the
run's plan (:func:`labkit.fault.chaos.fault_plan`: this one fault, or a chaos soak's stream), so the recovery time
(fault → first step after resume) can be measured — and so that each fires once: a restarted run passes a step
whose fault is on record without failing again, as a cluster does once a bad node is replaced. A straggler slows
its rank for ``fault.straggler_steps`` steps from its step (0: to the end), in every attempt.

When an attempt fails, each rank that sees it writes a ``detected`` record to the same file
(:func:`record_detection`): the time the failure reached it and the error it saw.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from labkit.fault.chaos import Planned, fault_plan
from labkit.fault.checkpoint import flip_byte, list_checkpoints
from labkit.metrics.events import EventWriter, read_events

FAULT_KINDS = ("none", "crash", "hang", "straggler", "nan", "corrupt_checkpoint")
CRASH_EXIT_CODE = 17  # what an injected crash exits with, to tell it apart in the agent's log


def restart_attempt() -> int:
    """How many times this run's process group was formed before this one: the count every rank agrees on
    (``labkit.distributed``'s store sets it); before the group exists, the agent's own restart count."""
    return int(os.environ.get("LABKIT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_fault(run_dir: str | Path, kind: str, rank: int, step: int, **fields) -> dict:
    """Append one fault record to ``RUN_DIR/faults.jsonl`` (several processes may append)."""
    writer = EventWriter(Path(run_dir) / "faults.jsonl")
    try:
        return writer.write("fault", kind=kind, rank=rank, step=step, attempt=restart_attempt(), **fields)
    finally:
        writer.close()


def record_detection(run_dir: str | Path, rank: int, error: str) -> None:
    """Write that this rank saw its attempt fail (``detected``, with the error) to ``RUN_DIR/faults.jsonl``."""
    writer = EventWriter(Path(run_dir) / "faults.jsonl")
    try:
        writer.write("detected", rank=rank, attempt=restart_attempt(), error=error[:300])
    finally:
        writer.close()


def fired_faults(run_dir: str | Path) -> set[int]:
    """The planned faults (their places in the plan) already on record in ``RUN_DIR/faults.jsonl``."""
    records, _ = read_events(Path(run_dir) / "faults.jsonl")
    return {r["planned"] for r in records if r.get("type") == "fault" and r.get("planned") is not None}


class FaultInjector:
    """Called by the training loop at fixed points; fires this rank's planned faults that are not on record yet."""

    def __init__(self, fault_cfg, rank: int, run_dir: str | Path, checkpoint_dir: Optional[Path] = None,
                 world: int = 1, steps: int = 0):
        self.straggler_s, self.straggler_steps = fault_cfg.straggler_ms / 1000, fault_cfg.straggler_steps
        self.rank, self.run_dir, self.checkpoint_dir = rank, Path(run_dir), checkpoint_dir
        self.plan = [f for f in fault_plan(fault_cfg, world, steps) if f.rank == rank and f.kind != "kill"]
        self.fired = fired_faults(self.run_dir) if self.plan else set()

    def _fires(self, kind: str, step: int) -> Optional[Planned]:
        """The planned fault of ``kind`` at ``step`` if it has not fired yet (and marks it fired), else None."""
        fault = next((f for f in self.plan if f.kind == kind and f.step == step and f.index not in self.fired), None)
        if fault is not None:
            self.fired.add(fault.index)
        return fault

    def _record(self, fault: Planned, step: int, **fields) -> None:
        record_fault(self.run_dir, fault.kind, self.rank, step, planned=fault.index, **fields)

    def before_step(self, step: int) -> None:
        """crash and hang act before the step's forward pass."""
        if fault := self._fires("crash", step):
            self._record(fault, step)
            os._exit(CRASH_EXIT_CODE)
        if fault := self._fires("hang", step):
            self._record(fault, step)
            while True:  # the other ranks wait in their next collective until comm.timeout_s
                time.sleep(3600)

    def arm(self, module, step: int) -> list:
        """nan and straggler act inside the step, through hooks on ``module`` (the model the step calls);
        returns their handles, for the loop to remove after the step."""
        hooks = []
        slow_s = self.extra_compute_s(step)
        if slow_s:
            hooks.append(module.register_forward_pre_hook(_sleep_once(slow_s)))  # counted as compute
        if self.poisons_gradients(step):
            hooks.append(module.register_forward_hook(_poison_loss))
        return hooks

    def extra_compute_s(self, step: int) -> float:
        """straggler: seconds this rank's compute is slowed by at this step (0 elsewhere)."""
        for fault in self.plan:
            last = step if self.straggler_steps == 0 else fault.step + self.straggler_steps - 1
            if fault.kind == "straggler" and fault.step <= step <= last:
                if self._fires("straggler", step):
                    self._record(fault, step, sleep_ms=self.straggler_s * 1000, steps=self.straggler_steps or None)
                return self.straggler_s
        return 0.0

    def poisons_gradients(self, step: int) -> bool:
        """True when this rank's loss (and so its gradients) must become NaN at this step."""
        if fault := self._fires("nan", step):
            self._record(fault, step)
            return True
        return False

    def after_checkpoint(self, step: int) -> None:
        """corrupt_checkpoint: flip a byte of the newest checkpoint, then crash."""
        if not (fault := self._fires("corrupt_checkpoint", step)):
            return
        newest = list_checkpoints(self.checkpoint_dir)
        target = flip_byte(newest[0]) if newest else None
        self._record(fault, step + 1, corrupted=str(target) if target else None)
        os._exit(CRASH_EXIT_CODE)


def _sleep_once(seconds: float):
    """A forward pre-hook: the step's first forward takes ``seconds`` longer (a slow node)."""
    pending = [True]

    def hook(module, args):
        if pending:
            pending.pop()
            time.sleep(seconds)

    return hook


def _poison_loss(module, args, output):
    """A forward hook: the loss (the model returns ``(logits, loss)``) becomes NaN, and so every gradient."""
    logits, loss = output
    return logits, loss * float("nan")
