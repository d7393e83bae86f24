"""What every worker does around its training, whichever trainer runs (the main loop or the CAP lab).

Start-up, in order:

1. join the process group and take a place on the rank grid (``labkit.distributed``);
2. check that every rank was given the same configuration;
3. install the emulated network, if the config asks for one (``labkit.comm.network``);
4. rank 0 opens the run's event log, ``RUN_DIR/events.jsonl``.

Shutdown, however the run ends (finished, failed, stopped by Ctrl-C or SIGTERM):

1. the ``closers`` run on every rank (undo anything set up outside the model);
2. rank 0 either notes the end of this attempt — the elastic agent will restart the group, so the run
   goes on — or completes the summary (the ``finishers`` add their numbers), writes the ``end`` event
   and ``summary.json``: a failed run keeps its data and says why;
3. a group this session started is destroyed, once the run finished (after a failure the agent ends
   the processes).

Use it as ``with WorkerSession(cfg, run_dir) as session:``, and keep every object that holds
communication state (a DDP module, a strategy) in a function called inside the ``with``: it must be
gone before the group is destroyed.

The main loop's callbacks are chosen here too (:func:`standard_callbacks`), not in ``labkit.callbacks``:
fault tolerance is one of them, and ``labkit.fault`` imports ``labkit.callbacks`` (its base class).
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from labkit.callbacks import Alerts, Callback, CompileCheck, Evaluation, EventLog, ExpertRouting, Progress
from labkit.comm import control
from labkit.comm.network import network_from_config, set_network
from labkit.distributed import init_distributed, shutdown_distributed
from labkit.fault.inject import record_detection, restart_attempt
from labkit.fault.tolerance import FaultTolerance
from labkit.metrics import EventWriter
from labkit.metrics.diagnosis import Watchdog
from labkit.metrics.events import attempt_ends_early, write_json
from labkit.model.moe import moe_layers
from labkit.parallel.mesh import GRADIENT_AXIS


def use_deterministic_kernels() -> None:
    """Deterministic kernels, so that a rerun is bit-for-bit the same, without NaN-filling new tensors.

    torch's deterministic mode also fills every uninitialised tensor (``torch.empty``) with NaN by
    default, so that code reading memory it never wrote fails loudly: a debugging aid that changes no
    correct result but writes every new activation buffer once more in each step (``aten::fill_`` in a
    profile of the step; ``benchmarks/overhead.py`` measures the loop against a bare one).
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


class Stopped(Exception):
    """Raised in a worker when it is asked to stop (SIGTERM from the agent, or Ctrl-C)."""


_stop_signals: list[int] = []  # the stop signals this process received (stop_on_signal), oldest first


def stop_on_signal(signum: int, frame=None) -> None:
    """A worker's handler for SIGTERM and SIGINT: note that it was asked to stop, then raise :class:`Stopped`
    (``KeyboardInterrupt`` for SIGINT, as Python's own handler does).

    The session reads the note, not only the exception: Python raises it wherever the main thread is when the
    signal lands, and there torch may swallow it. A torch future's ``then`` callback runs on the main thread when
    the collective has already completed (labkit's timed collectives attach one); an exception raised inside it
    is stored in the future as a RuntimeError ("Got the following error when running the callback:
    KeyboardInterrupt"), which the wait raises instead. Without the note, rank 0 of a run stopped by Ctrl-C
    would write it down as failed.
    """
    _stop_signals.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(f"signal {signum}")


def note_stop_signal(signum: int, frame=None) -> None:
    """A leaving worker's handler for SIGTERM and SIGINT: note the stop, raise nothing. Once the worker is on its
    way out (an error unwinding to torch's ``@record``, which writes the error file the elastic agent reads), a
    stop raised there would cut that file short: the agent reads an empty one and fails itself
    (``JSONDecodeError``), and the run with it."""
    _stop_signals.append(signum)


def stop_signal() -> int | None:
    """The first stop signal this process received through :func:`stop_on_signal`, or None."""
    return _stop_signals[0] if _stop_signals else None


def check_same_config(cfg) -> None:
    """Every rank must train the same configuration; a mismatch is an error, not a silent divergence."""
    mine = json.dumps(cfg.to_dict(), sort_keys=True)
    if control.broadcast_object(mine, src=0) != mine:
        raise ValueError(f"rank {dist.get_rank()} has a different configuration from rank 0; start every rank "
                         "with the same config file and --set overrides")


class WorkerSession:
    def __init__(self, cfg, run_dir: str | Path, **summary):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.summary: dict = {"status": "failed", **summary}
        self.closers: list[Callable[[], None]] = []  # every rank, at exit
        self.finishers: list[Callable[[dict], None]] = []  # rank 0, when the run (not just an attempt) ends
        self.t0 = time.time()

    def __enter__(self) -> "WorkerSession":
        self.started_group = not dist.is_initialized()
        self.env = init_distributed(self.cfg)
        check_same_config(self.cfg)
        set_network(network_from_config(self.cfg.comm))
        self.sink = EventWriter(self.run_dir / "events.jsonl") if self.env.is_main else None
        return self

    def finished(self, **fields) -> None:
        """The trainer's work is done: mark the run finished, with its closing numbers."""
        self.summary.update(status="finished", **fields)

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, (Stopped, KeyboardInterrupt)):
            self.summary.update(status="stopped", error=str(error) or "interrupted")
        elif error is not None and stop_signal() is not None:  # the stop, turned into this error on the way
            self.summary.update(status="stopped", error=f"signal {stop_signal()} (then the worker saw: "
                                                        f"{type(error).__name__}: {error})")
        elif error is not None:
            self.summary.update(status="failed", error=f"{type(error).__name__}: {error}")
        if error is not None:  # when the failure (or the agent's stop after another rank's) reached this rank
            record_detection(self.run_dir, self.env.rank, self.summary["error"])
        try:
            for close in self.closers:
                close()
        finally:
            self.closers.clear()  # they may hold modules with communication hooks: gone before the group
            if self.env.is_main:
                self._write_end()
        if self.started_group and self.summary["status"] == "finished":
            shutdown_distributed()
        return False  # an error propagates: the agent sees the worker fail

    def _write_end(self) -> None:
        attempt = restart_attempt()
        if attempt_ends_early(self.summary, self.run_dir, attempt, self.cfg.fault.max_restarts):
            # the elastic agent will start another attempt: the run has not ended
            self.sink.write("attempt_end", status=self.summary["status"], error=self.summary.get("error"),
                            attempt=attempt)
        else:
            for finish in self.finishers:
                finish(self.summary)
            self.sink.write("end", status=self.summary["status"])
            write_json(self.run_dir / "summary.json", self.summary)
        self.sink.close()

    def result(self) -> dict | None:
        """Rank 0's summary (other ranks: None)."""
        return self.summary if self.env.is_main else None


def standard_callbacks(cfg, env, run_dir, sink, val_ds, model, summary: dict) -> list[Callback]:
    """The loop's callbacks for ``cfg``, in the order they run (the table in ``labkit.callbacks``).

    ``summary`` is the run's summary: a compile decision and the latest validation loss go in as they
    are measured, so a run that fails later keeps them; the others add theirs when the run finishes.
    """
    callbacks: list[Callback] = []
    if cfg.run.compile == "verify":  # run.compile=on compiled the model as it was built (apply_compile)
        callbacks.append(CompileCheck(model, sink, summary))
    if cfg.model.moe.experts > 0:  # a mixture of experts: its routing in the step event, loss-free balancing's step
        callbacks.append(ExpertRouting(moe_layers(model), replica_sum(env), stage_gather(env)))
    callbacks.append(EventLog(sink, cfg.metrics.log_every))
    if cfg.metrics.alerts:
        callbacks.append(Alerts(Watchdog(cfg.metrics, env, run_dir, sink)))
    callbacks.append(Evaluation(val_ds, cfg.run.eval_every, cfg.run.steps, sink, summary))
    callbacks.append(FaultTolerance(cfg, env, run_dir, sink))
    if Progress.wanted(cfg.metrics, env.is_main):
        callbacks.append(Progress(cfg.run.steps, f"train ×{env.world_size} {env.backend}"))
    return callbacks


def stage_gather(env):
    """Each pipeline stage's object, gathered over the pp axis in stage order (every pp rank calls it), or None
    without a pipeline."""
    if env.grid.size("pp") == 1:
        return None
    group = env.grid.group("pp")
    return lambda obj: control.all_gather_objects(obj, group=group)


def replica_sum(env):
    """An in-place sum over the ranks holding the same parameters (the gradient axis), or None for one."""
    if env.grid.size(GRADIENT_AXIS) == 1:
        return None
    group = env.grid.group(GRADIENT_AXIS)
    return lambda tensor: control.sum_over_ranks(tensor, group)
