"""Starting, watching and stopping a multi-process run.

Two ways in, one machinery underneath (torch's elastic agent, the engine of ``torchrun``):

* ``labkit train CONFIG --nproc N`` runs the agent in the CLI process; the agent starts N
  workers (``python -m labkit train ...`` with ``RANK``/``WORLD_SIZE`` set) and restarts them on
  failure within ``fault.max_restarts``.
* ``labkit.launch(config, nproc)`` — for notebooks — starts that same CLI in a child process and
  returns a :class:`Run` handle at once. The notebook never hosts the agent (it installs signal
  handlers) and never forks workers from notebook-defined functions (they cannot be pickled).

Nothing outlives its owner: ``Run.stop()``, a kernel interrupt during ``Run.wait()``, the
notebook exiting, or the notebook being killed (the child watches its parent) all end every
worker. The run directory is the only thing shared between the notebook and the workers.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Union

from labkit.config import Config, ConfigError, load_config, parse_override, save_config, validate
from labkit.metrics.events import STEP_COLUMNS, final_trajectory, read_events, request_stop, write_json

_LIVE_RUNS: "set[Run]" = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_run_dir(cfg: Config) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.runs_dir) / f"{cfg.run.name}-{stamp}-{uuid.uuid4().hex[:4]}"


def prepare_run(cfg: Config, nproc: int, run_dir: Union[str, Path, None] = None) -> Path:
    """Validate, then create the run directory with its ``config.json``. Never overwrites a run."""
    validate(cfg, nproc=nproc)
    run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
    if (run_dir / "events.jsonl").exists():
        raise ConfigError([f"run directory {str(run_dir)!r} already holds a run (events.jsonl); "
                           "choose a new --run-dir so its data is not overwritten"])
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.json")
    (run_dir / "launch.json").write_text(json.dumps({"nproc": nproc, "nnodes": 1, "created": time.time()}) + "\n")
    return run_dir


def worker_threads_env(cfg: Config, nproc: int) -> dict[str, str]:
    from labkit.distributed import threads_per_proc

    n = str(threads_per_proc(cfg, nproc))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def run_elastic(run_dir: Path, nproc: int, cfg: Config) -> int:
    """Run the elastic agent here until the workers finish; returns an exit code."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    os.environ.update(worker_threads_env(cfg, nproc))
    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_dir.name,
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              local_addr="127.0.0.1", max_restarts=cfg.fault.max_restarts,
                              start_method="spawn", monitor_interval=0.1)
    args = ["-m", "labkit", "train", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    try:
        elastic_launch(launch_cfg, sys.executable)(*args)
        return 0
    except ChildFailedError as failure:
        first = failure.get_first_failure()[1]
        print(f"labkit: worker (local rank {first.local_rank}) failed (exit code {first.exitcode}); "
              f"see {run_dir}/summary.json and the log above", file=sys.stderr)
        ensure_summary(run_dir, "failed", f"worker exit code {first.exitcode}")
        return 1
    except SignalException as stop:
        print(f"labkit: stopped by {stop.sigval.name}; workers ended", file=sys.stderr)
        ensure_summary(run_dir, "stopped", f"signal {stop.sigval.name}")
        return 128 + int(stop.sigval)


def ensure_summary(run_dir: Path, status: str, error: str) -> None:
    """A run stopped before its workers could write anything still ends with an end event and summary."""
    if (run_dir / "summary.json").exists():
        return
    with open(run_dir / "events.jsonl", "a") as events:
        events.write(json.dumps({"type": "end", "time": time.time(), "status": status}) + "\n")
    write_json(run_dir / "summary.json", {"status": status, "error": error, "steps_completed": 0})


def when_parent_dies(action, parent_pid: Optional[int] = None, poll_s: float = 0.5) -> None:
    """Run ``action`` (in a daemon thread) once this process's parent is gone: no orphan keeps a core busy.

    A dead parent's children are adopted by another process, so a changed ``getppid()`` is the signal.
    """
    parent_pid = parent_pid or os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        action()

    threading.Thread(target=watch, name="labkit-parent-watch", daemon=True).start()


def watch_parent_from_env() -> None:
    """In the launcher child: if the notebook dies, stop like a Ctrl-C (the agent then ends the workers)."""
    if os.environ.get("LABKIT_PARENT_PID"):
        when_parent_dies(lambda: os.kill(os.getpid(), signal.SIGTERM), int(os.environ["LABKIT_PARENT_PID"]))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Run:
    """A handle on a run started by :func:`launch`: watch it, wait for it, stop it."""

    def __init__(self, run_dir: Path, process: Optional[subprocess.Popen], nproc: int):
        self.run_dir = Path(run_dir)
        self.process = process
        self.nproc = nproc
        self._events: list[dict] = []
        self._offset = 0
        self._stopped = False
        self._worker_pids: set[int] = set()
        _LIVE_RUNS.add(self)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r}, steps={len(self.metrics.get('step', []))})"

    # ---------------------------------------------------------------- reading
    def events(self) -> list[dict]:
        """All events written so far (new ones are read incrementally)."""
        new, self._offset = read_events(self.run_dir / "events.jsonl", self._offset)
        self._events.extend(new)
        self._note_worker_pids()
        return list(self._events)

    @property
    def metrics(self) -> dict[str, list]:
        """Step events as columns: ``run.metrics["loss"]`` is the loss of every logged step.

        After a restart, the steps recomputed from the checkpoint replace those the failed attempt
        logged (:func:`labkit.metrics.events.final_trajectory`); ``events()`` keeps every attempt.
        """
        steps = final_trajectory(self.events())
        keys = [k for k in steps[0] if k != "type"] if steps else STEP_COLUMNS
        return {k: [e.get(k) for e in steps] for k in keys}

    @property
    def summary(self) -> Optional[dict]:
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None

    @property
    def status(self) -> str:
        """``running``, then ``finished``, ``stopped`` or ``failed``."""
        summary = self.summary or {}
        if self.process is None:  # a run opened from its directory
            return summary.get("status", "unknown")
        code = self.process.poll()
        if code is None:
            return "running"
        if self._stopped or summary.get("status") == "stopped":
            return "stopped"
        return "finished" if code == 0 and summary.get("status") == "finished" else "failed"

    def log(self) -> str:
        """The launcher's and workers' console output."""
        try:
            return (self.run_dir / "launcher.log").read_text()
        except OSError:
            return ""

    # ---------------------------------------------------------------- waiting and stopping
    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until the run ends; a kernel interrupt (Ctrl-C) stops the run, then re-raises."""
        if self.process is None:
            return self.status
        try:
            self.process.wait(timeout)
        except KeyboardInterrupt:
            self.stop()
            raise
        self._cleanup()
        return self.status

    def stop(self, grace_s: float = 10.0) -> str:
        """End the run and every worker: SIGTERM to the launcher (it ends its workers), then SIGKILL."""
        self._note_worker_pids()
        if self.process is not None and self.process.poll() is None:
            self._stopped = True
            request_stop(self.run_dir)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self._cleanup()  # workers are gone: nothing can write the summary any more
            ensure_summary(self.run_dir, "stopped", "stopped before the workers wrote a summary")
        else:
            self._cleanup()
        return self.status

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one worker from outside, as a failing node would vanish; returns its pid.

        The fault is recorded first (``faults.jsonl``) so the recovery time can be measured. With
        ``fault.max_restarts`` left, the elastic agent restarts the group and the run resumes from
        its newest valid checkpoint.
        """
        return kill_rank(self.run_dir, rank)

    def _note_worker_pids(self) -> None:
        for pid_file in (self.run_dir / "pids").glob("rank*.pid"):
            try:
                self._worker_pids.add(int(pid_file.read_text()))
            except (OSError, ValueError):
                pass

    def _cleanup(self) -> None:
        """Workers live in sessions of their own: make sure none outlived the agent."""
        deadline = time.time() + 5
        for pid in self._worker_pids:
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 5  # SIGKILL is not instant on a busy machine: return once it has landed
        while any(_alive(pid) for pid in self._worker_pids) and time.time() < deadline:
            time.sleep(0.02)
        _LIVE_RUNS.discard(self)

    @property
    def worker_pids(self) -> set[int]:
        self._note_worker_pids()
        return set(self._worker_pids)


def kill_rank(run_dir: Union[str, Path], rank: int) -> int:
    """SIGKILL the worker of ``rank`` in a live run (see :meth:`Run.kill_rank`)."""
    from labkit.fault.inject import record_fault
    from labkit.fault.recovery import last_step_seen

    run_dir = Path(run_dir)
    pid_file = run_dir / "pids" / f"rank{rank}.pid"
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        live = sorted(p.stem for p in (run_dir / "pids").glob("rank*.pid"))
        raise ValueError(f"no live worker of rank {rank} in {run_dir} (live: {', '.join(live) or 'none'}); "
                         "is the run still running?") from None
    last = last_step_seen(run_dir)
    record_fault(run_dir, "kill", rank, 0 if last is None else last + 1, pid=pid)
    os.kill(pid, signal.SIGKILL)
    return pid


def launch(config: Union[Config, str, Path], nproc: int = 2, run_dir: Union[str, Path, None] = None,
           overrides: Union[list[str], dict, None] = None) -> Run:
    """Validate ``config``, start ``nproc`` workers in the background, and return a :class:`Run`."""
    cfg = config if isinstance(config, Config) else load_config(config)
    if overrides:
        cfg = cfg.replace(**(overrides if isinstance(overrides, dict) else dict(map(parse_override, overrides))))
    run_dir = prepare_run(cfg, nproc, run_dir)
    env = {**os.environ, "LABKIT_PARENT_PID": str(os.getpid()), "LABKIT_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "labkit", "train", str(run_dir / "config.json"), "--nproc", str(nproc),
           "--run-dir", str(run_dir)]
    with open(run_dir / "launcher.log", "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    return Run(run_dir, process, nproc)


def open_run(run_dir: Union[str, Path]) -> Run:
    """Read a run back from its directory (finished, stopped, or still going elsewhere)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a labkit run directory (no config.json)")
    launch_info = json.loads((run_dir / "launch.json").read_text()) if (run_dir / "launch.json").exists() else {}
    run = Run(run_dir, None, launch_info.get("nproc", 1))
    _LIVE_RUNS.discard(run)
    return run


@atexit.register
def _stop_live_runs() -> None:
    for run in list(_LIVE_RUNS):
        run.stop(grace_s=5)
