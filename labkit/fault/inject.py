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

One-shot faults fire only in the first attempt (:func:`restart_attempt` 0): the restarted
run passes the same step without failing again, as a cluster does once a bad node is replaced.
Every fault is written to ``RUN_DIR/faults.jsonl`` *before* it happens, with a timestamp, so
the recovery time (fault → first step after resume) can be measured.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from labkit.fault.checkpoint import flip_byte, list_checkpoints
from labkit.metrics.events import EventWriter

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


class FaultInjector:
    """Called by the training loop at fixed points; does nothing unless this rank is the target."""

    def __init__(self, fault_cfg, rank: int, run_dir: str | Path, checkpoint_dir: Optional[Path] = None):
        self.kind, self.step, self.target = fault_cfg.inject, fault_cfg.inject_step, fault_cfg.inject_rank
        self.straggler_s = fault_cfg.straggler_ms / 1000
        self.rank, self.run_dir, self.checkpoint_dir = rank, Path(run_dir), checkpoint_dir
        self.active = self.kind != "none" and rank == self.target
        self.first_attempt = restart_attempt() == 0

    def _fires(self, kind: str, step: int) -> bool:
        return self.active and self.kind == kind and step == self.step and self.first_attempt

    def before_step(self, step: int) -> None:
        """crash and hang act before the step's forward pass."""
        if self._fires("crash", step):
            record_fault(self.run_dir, "crash", self.rank, step)
            os._exit(CRASH_EXIT_CODE)
        if self._fires("hang", step):
            record_fault(self.run_dir, "hang", self.rank, step)
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
        if not (self.active and self.kind == "straggler" and step >= self.step):
            return 0.0
        if step == self.step:
            record_fault(self.run_dir, "straggler", self.rank, step, sleep_ms=self.straggler_s * 1000)
        return self.straggler_s

    def poisons_gradients(self, step: int) -> bool:
        """True when this rank's loss (and so its gradients) must become NaN at this step."""
        if self._fires("nan", step):
            record_fault(self.run_dir, "nan", self.rank, step)
            return True
        return False

    def after_checkpoint(self, step: int) -> None:
        """corrupt_checkpoint: flip a byte of the newest checkpoint, then crash."""
        if not self._fires("corrupt_checkpoint", step):
            return
        newest = list_checkpoints(self.checkpoint_dir)
        target = flip_byte(newest[0]) if newest else None
        record_fault(self.run_dir, "corrupt_checkpoint", self.rank, step + 1,
                     corrupted=str(target) if target else None)
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
