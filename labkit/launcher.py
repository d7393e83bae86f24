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
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional, Union

from labkit.config import Config, ConfigError, load_config, parse_override, resolve_strategy, save_config
from labkit.validation import machine_warnings, validate
from labkit.metrics.events import (STEP_COLUMNS, EventHistory, final_trajectory, read_events, request_stop,
                                   write_json)

_LIVE_RUNS: "set[Run]" = set()
_CPU_HOGS: "set[subprocess.Popen]" = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_run_dir(cfg: Config) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.runs_dir) / f"{cfg.run.name}-{stamp}-{uuid.uuid4().hex[:4]}"


def prepare_run(cfg: Config, nproc: int, run_dir: Union[str, Path, None] = None) -> Path:
    """Validate, then create the run directory with its ``config.json``. Never overwrites a run.

    A directory this function already prepared for the same config and process count (``launch``
    prepares it, then the agent it starts calls this again) is taken as it is: validated once.
    """
    run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
    if (run_dir / "events.jsonl").exists():
        raise ConfigError([f"run directory {str(run_dir)!r} already holds a run (events.jsonl); "
                           "choose a new --run-dir so its data is not overwritten"])
    if validated_for(run_dir, cfg, nproc):
        return run_dir
    validate(cfg, nproc=nproc)
    warnings = machine_warnings(cfg, nproc)
    for warning in warnings:
        print(f"labkit: warning: {warning}", file=sys.stderr)
    chosen = launch_choices(cfg)  # the CLI prints them; a notebook's launch() finds them here and in launcher.log
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.json")
    (run_dir / "launch.json").write_text(json.dumps({"nproc": nproc, "nnodes": 1, "created": time.time(),
                                                     "validated": True, "warnings": warnings,
                                                     "auto": chosen}) + "\n")
    return run_dir


def launch_choices(cfg: Config) -> dict[str, str]:
    """What ``auto`` settings resolve to before any worker starts, with why (the data-parallel strategy; each worker
    resolves it again the same way and its start event's ``auto`` records it). ``config.json`` keeps ``auto``."""
    _, why = resolve_strategy(cfg)
    return {"parallel.dp.strategy": why} if why else {}


def validated_for(run_dir: Path, cfg: Config, nproc: Optional[int] = None) -> bool:
    """Whether :func:`prepare_run` validated ``cfg`` (for ``nproc`` processes, if given) into ``run_dir``."""
    try:
        launch_info = json.loads((run_dir / "launch.json").read_text())
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (launch_info.get("validated") is True and saved == json.loads(json.dumps(cfg.to_dict()))
            and (nproc is None or launch_info.get("nproc") == nproc))


def worker_threads_env(cfg: Config, nproc: int) -> dict[str, str]:
    from labkit.distributed import threads_per_proc

    n = str(threads_per_proc(cfg, nproc))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def record_rendezvous(run_dir: Path, endpoint: str) -> str:
    """Keep the rendezvous endpoint a run's agent serves in its ``launch.json`` (``rendezvous``): runs started side
    by side (a hub's seats) can be checked for a shared port afterwards."""
    path = run_dir / "launch.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**info, "rendezvous": endpoint}) + "\n")
    return endpoint


def run_elastic(run_dir: Path, nproc: int, cfg: Config) -> int:
    """Run the elastic agent here until the workers finish; returns an exit code."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    os.environ.update(worker_threads_env(cfg, nproc))
    endpoint = record_rendezvous(run_dir, f"127.0.0.1:{free_port()}")
    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_dir.name,
                              rdzv_backend="c10d", rdzv_endpoint=endpoint,
                              local_addr="127.0.0.1", max_restarts=cfg.fault.max_restarts,
                              rdzv_timeout=round(cfg.fault.rendezvous_timeout_s),
                              start_method="spawn", monitor_interval=0.1)
    args = ["-m", "labkit", "train", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    try:
        elastic_launch(launch_cfg, sys.executable)(*args)
        return 0
    except ChildFailedError as failure:
        first = failure.get_first_failure()[1]
        print(f"labkit: worker (local rank {first.local_rank}) failed (exit code {first.exitcode}); "
              f"see {run_dir}/summary.json and the log above", file=sys.stderr)
        record_failure(run_dir, failure_reason(first))
        return 1
    except SignalException as stop:
        print(f"labkit: stopped by {stop.sigval.name}; workers ended", file=sys.stderr)
        ensure_summary(run_dir, "stopped", f"signal {stop.sigval.name}")
        return 128 + int(stop.sigval)


def failure_reason(failure) -> str:
    """What the first worker to fail said (torch elastic's error file, which ``@record`` on the worker's
    entry point writes) or the signal that ended it; only its exit code when it left no word."""
    wrote = bool(failure.error_file) and os.path.isfile(failure.error_file)
    said = failure.message if wrote or failure.exitcode < 0 else ""
    return f"worker exit code {failure.exitcode}" + (f": {said}" if said else "")


def record_failure(run_dir: Path, error: str) -> None:
    """The run failed because a worker did. Rank 0 may have written itself down as stopped (the agent
    ends the other workers once one fails) or not at all (it was ended first): either way the summary
    says failed, and why."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return ensure_summary(run_dir, "failed", error)
    if summary.get("status") != "failed":
        write_json(path, {**summary, "status": "failed", "error": error})


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


def exit_when_orphaned() -> None:
    """In a worker: end at once if its parent (the elastic agent) dies."""
    when_parent_dies(lambda: os._exit(1))


def watch_parent_from_env() -> None:
    """In the launcher child: if the notebook dies, stop like a Ctrl-C (the agent then ends the workers)."""
    if os.environ.get("LABKIT_PARENT_PID"):
        when_parent_dies(lambda: os.kill(os.getpid(), signal.SIGTERM), int(os.environ["LABKIT_PARENT_PID"]))


# ---------------------------------------------------------------- a busy core, on purpose
def spin_until_orphaned(parent_pid: int) -> None:
    """Keep one core at 100% (a busy loop) until process ``parent_pid`` is no longer this one's parent."""
    when_parent_dies(lambda: os._exit(0), parent_pid, poll_s=0.2)
    while True:
        pass


def start_cpu_hog() -> subprocess.Popen:
    """A child process that keeps one core busy, to show what a noisy neighbour does to a run.

    It ends with :func:`stop_cpu_hog`, when this interpreter exits, or when this process dies
    (even by SIGKILL: the hog watches its parent), like every worker.
    """
    code = f"from labkit.launcher import spin_until_orphaned; spin_until_orphaned({os.getpid()})"
    hog = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    _CPU_HOGS.add(hog)
    return hog


def stop_cpu_hog(hog: subprocess.Popen) -> None:
    hog.kill()
    hog.wait()
    _CPU_HOGS.discard(hog)


@contextmanager
def cpu_hog():
    """``with cpu_hog():`` one core is busy inside the block (see :func:`start_cpu_hog`)."""
    hog = start_cpu_hog()
    try:
        yield hog
    finally:
        stop_cpu_hog(hog)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# ---------------------------------------------------------------- which process is a worker
class WorkerProcess(NamedTuple):
    """A worker told apart from any later process given the same pid: its pid and its start time."""
    pid: int
    start: Optional[int]  # field 22 of /proc/PID/stat (clock ticks after boot); None: not recorded


def process_start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (field 22 of /proc/PID/stat), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # fields from 3 (state) on, after the name
    except (OSError, IndexError, ValueError):
        return None


def start_file(pid_file: Path) -> Path:
    """``rankN.start`` next to ``rankN.pid``: the worker's start time (the pid file holds only its pid)."""
    return pid_file.with_suffix(".start")


def write_pid_file(pid_dir: Path, rank: Union[int, str], worker: Optional[WorkerProcess] = None) -> Path:
    """Record ``worker`` (this process by default) as ``rank{rank}.pid`` and ``rank{rank}.start``.

    The start time is written first and the pid file is renamed into place whole, so whoever sees
    the pid file can also read the start time.
    """
    worker = worker or WorkerProcess(os.getpid(), process_start_time(os.getpid()))
    pid_dir.mkdir(parents=True, exist_ok=True)
    pid_file, partial = pid_dir / f"rank{rank}.pid", pid_dir / f".rank{rank}.pid.partial"
    start_file(pid_file).write_text(str(worker.start))
    partial.write_text(str(worker.pid))
    partial.replace(pid_file)
    return pid_file


def remove_pid_file(pid_file: Path) -> None:
    pid_file.unlink(missing_ok=True)
    start_file(pid_file).unlink(missing_ok=True)


def read_pid_file(pid_file: Path) -> WorkerProcess:
    """The worker a pid file names (``start`` None for a pid file without a start time: never signalled).

    Raises ``OSError`` or ``ValueError`` if the pid file is missing or unreadable.
    """
    pid = int(pid_file.read_text())
    try:
        start = int(start_file(pid_file).read_text())
    except (OSError, ValueError):
        start = None
    return WorkerProcess(pid, start)


def is_running(worker: WorkerProcess) -> bool:
    """The very process that wrote the pid file is alive, not another one that got its pid later."""
    return worker.start is not None and _alive(worker.pid) and process_start_time(worker.pid) == worker.start


def signal_worker(worker: WorkerProcess, sig: int) -> bool:
    """Send ``sig`` to ``worker`` only while its pid still names that very process; True if sent.

    A pidfd holds on to the process between the check and the signal, so a pid reused in between
    cannot receive it.
    """
    try:
        pinned = os.pidfd_open(worker.pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds here (an old kernel, a seccomp filter): check, then signal by pid
        pinned = None
    try:
        if not is_running(worker):
            return False
        if pinned is None:
            os.kill(worker.pid, sig)
        else:
            signal.pidfd_send_signal(pinned, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if pinned is not None:
            os.close(pinned)


class Run:
    """A handle on a run started by :func:`launch`: watch it, wait for it, stop it."""

    def __init__(self, run_dir: Path, process: Optional[subprocess.Popen], nproc: int):
        self.run_dir = Path(run_dir)
        self.process = process
        self.nproc = nproc
        self._events = EventHistory()  # bounded: a 100,000-step run holds ~4,000 step events, newest whole
        self._offset = 0
        self._stopped = False
        self._workers: set[WorkerProcess] = set()  # every worker seen in pids/, by pid and start time
        _LIVE_RUNS.add(self)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r}, steps={len(self.metrics.get('step', []))})"

    # ---------------------------------------------------------------- reading
    def events(self) -> list[dict]:
        """The events written so far, read incrementally: every one of a short run; for a long run, older
        step events thinned so memory stays bounded (:class:`~labkit.metrics.events.EventHistory`).
        ``events.jsonl`` itself keeps every line."""
        new, self._offset = read_events(self.run_dir / "events.jsonl", self._offset)
        self._events.extend(new)
        self._note_worker_pids()
        return self._events.snapshot()

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
                self._workers.add(read_pid_file(pid_file))
            except (OSError, ValueError):
                pass

    def _cleanup(self) -> None:
        """Workers live in sessions of their own: make sure none outlived the agent.

        Only the processes that wrote the pid files are signalled, never a later one given the same pid.
        """
        deadline = time.time() + 5
        for worker in self._workers:
            while is_running(worker) and time.time() < deadline:
                time.sleep(0.05)
            signal_worker(worker, signal.SIGKILL)
        deadline = time.time() + 5  # SIGKILL is not instant on a busy machine: return once it has landed
        while any(is_running(worker) for worker in self._workers) and time.time() < deadline:
            time.sleep(0.02)
        _LIVE_RUNS.discard(self)

    @property
    def worker_pids(self) -> set[int]:
        self._note_worker_pids()
        return {worker.pid for worker in self._workers}


def kill_rank(run_dir: Union[str, Path], rank: int, **fields) -> int:
    """SIGKILL the worker of ``rank`` in a live run (see :meth:`Run.kill_rank`); ``fields`` go into the fault's
    record (a chaos soak's place in its plan)."""
    from labkit.fault.inject import record_fault
    from labkit.fault.recovery import last_step_seen

    run_dir = Path(run_dir)
    pid_file = run_dir / "pids" / f"rank{rank}.pid"
    try:
        worker = read_pid_file(pid_file)
    except (OSError, ValueError):
        raise ValueError(_no_live_worker(run_dir, rank, "is the run still running?")) from None
    if not is_running(worker):
        raise ValueError(_no_live_worker(run_dir, rank, f"{pid_file} names pid {worker.pid}, which is not "
                                                        "the worker that wrote it any more: not signalled"))
    last = last_step_seen(run_dir)
    record_fault(run_dir, "kill", rank, 0 if last is None else last + 1, pid=worker.pid, **fields)
    signal_worker(worker, signal.SIGKILL)
    return worker.pid


def _no_live_worker(run_dir: Path, rank: int, why: str) -> str:
    live = sorted(p.stem for p in (run_dir / "pids").glob("rank*.pid"))
    return f"no live worker of rank {rank} in {run_dir} (pid files: {', '.join(live) or 'none'}); {why}"


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


@atexit.register
def _stop_cpu_hogs() -> None:
    for hog in list(_CPU_HOGS):
        stop_cpu_hog(hog)
