"""Drawing beside a run without slowing it: a low-priority process renders the live figures.

A live figure is drawn on the cores the workers train on. On a 2-core machine a redraw that takes a core for
half a second is half a second taken from a worker — and the ranks step in lock-step, so the other rank waits
for it: throughput dips at every redraw (a sawtooth with the redraw's period). So a dashboard does not draw in
the notebook's kernel while the run goes:

* **another process draws** (:class:`Painter`): the kernel asks for a frame of a run's events file and shows
  the PNG it gets back, so drawing holds neither the kernel's interpreter lock nor its priority;
* **at the lowest priority an unprivileged process can take**: Linux's SCHED_IDLE class and nice 19 — and,
  because Linux's default scheduler shares the CPU between sessions' *autogroups* before any nice value counts
  (the run's workers each lead a session of their own), in a session of its own whose autogroup is niced too.
  It draws in the CPU time the workers leave while they wait on communication, and a worker that wakes up takes
  its CPU back at once;
* **within a budget** (the caller's part: :class:`~labkit.widgets.dashboard.RunDashboard`): only when something
  changed, never two frames at once, and no sooner than a frame's CPU cost divided by :data:`FRAME_SHARE` after
  the previous one (:func:`frame_gap`);
* **raised only when starved**: where every core is busy no time is left to draw in, so a frame that came back
  slowly (:data:`LATE_S`) raises the painter's session a step (:data:`BOOST_NICE`), and frames on time lower it
  again: the least priority that still gives a live picture.

``benchmarks/dashboard_cost.py`` measures what is left: the same run with and without a dashboard following it.
"""
from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

LOWEST = 19  # the largest nice value: the least CPU when others want it
FRAME_SHARE = 0.15
"""A frame's CPU time is at most this share of the wall clock between two frames' starts: a frame of the dashboard
takes about 0.2–0.35 CPU s (2 cores, the workers busy), so at 15% one comes every 2–2.5 s, taken at SCHED_IDLE
from the time the workers leave. ``benchmarks/dashboard_cost.py --browser`` measures what it costs them and how
far apart the frames reach the browser."""
AUTOGROUP = Path("/proc/self/autogroup")  # Linux: "/autogroup-N nice K"; writing a number sets K
BOOST_NICE = (LOWEST, 14, 10)
"""The painter's session's nice values, lowest priority first. At nice 19 a frame is drawn in the time the workers
leave; on a machine with none left (every core busy) it can wait tens of seconds, so a dashboard whose frame came
late (:data:`LATE_S`) raises its painter one step, and lowers it again when frames come on time. At nice 10 the
painter's session weighs about a tenth of a busy worker's: a frame of 0.2 CPU s within about 2 s."""
LATE_S = 1.0  # a frame whose drawing took longer than this on the wall clock (0.2 CPU s) was starved of CPU
RUNS_KEPT = 8  # runs whose events the painter keeps in memory (the most recently drawn)


def frame_gap(every_s: float, frame_cpu_s: float, share: float = FRAME_SHARE) -> float:
    """Seconds from one frame's start to the next: the period asked for, or longer if frames cost more."""
    return max(every_s, frame_cpu_s / share)


def frame_gaps(frame_times: list[float], run_end: float) -> list[float]:
    """Seconds between the frames a viewer received while a run went, from the first frame to the run's end: each
    frame to the next, and the last frame before the end to the end (frames after it are left out). Empty
    without a frame before the end."""
    live = sorted(t for t in frame_times if t <= run_end)
    return [b - a for a, b in zip(live, [*live[1:], run_end])]


def timed(draw: Callable, *args) -> tuple:
    """``(draw(*args), CPU seconds of this thread, start, end)``, start and end on the wall clock."""
    started, cpu = time.time(), time.thread_time()
    value = draw(*args)
    return value, time.thread_time() - cpu, started, time.time()


def autogroup_nice() -> Optional[int]:
    """This process's autogroup's nice value, or None without autogroups (or without access)."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, IndexError, ValueError):
        return None


def set_autogroup_nice(value: int, tries: int = 20, path: Path = AUTOGROUP) -> None:
    """Set this process's autogroup's nice value, or (``path``: ``/proc/PID/autogroup``) that of another process of
    this user (0–19 needs no privilege; the kernel refuses a change within 100 ms of another one, anyone's, with
    EAGAIN: retried for up to a second)."""
    for _ in range(tries):
        try:
            path.write_text(str(value))
            return
        except BlockingIOError:
            time.sleep(0.05)


def lower_priority() -> None:
    """This process to the lowest priority: its session's autogroup niced (it was started in a session of its own),
    itself niced, and — Linux — in the SCHED_IDLE class, so that a CPU running only the painter counts as idle
    when a worker wakes up (from a collective, say) and the worker takes it at once."""
    for lower in (lambda: set_autogroup_nice(LOWEST), lambda: os.nice(LOWEST - os.nice(0)),
                  lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))):
        try:
            lower()
        except (AttributeError, OSError):  # not on this OS, or not allowed: the others still apply
            pass


class EventsFile:
    """A run's events as the painter holds them: read incrementally, bounded (what ``Run.events()`` does)."""

    def __init__(self, path: str):
        from labkit.metrics.events import EventHistory

        self.path, self.offset, self.history = path, 0, EventHistory()

    def read(self) -> list[dict]:
        from labkit.metrics.events import read_events

        new, self.offset = read_events(self.path, self.offset)
        self.history.extend(new)
        return self.history.snapshot()


def serve(requests, replies) -> None:
    """The painter process: answer each request ``(figure, events_path, title)`` — ``figure`` is
    ``"module:function"``, called as ``function(events, title)`` — with ``timed``'s tuple around the PNG, or an
    error's text; ``("describe",)`` with its priority. Ends when the kernel closes the pipe (or dies)."""
    from labkit.launcher import when_parent_dies  # at the lowest priority already (main): labkit imports torch

    when_parent_dies(lambda: os._exit(0))  # the kernel killed mid-frame: no painter outlives it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel interrupt is for the kernel
    import labkit.plots  # noqa: F401 — matplotlib, imported while the caller waits for its first frame anyway

    files: dict[str, EventsFile] = {}
    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):
            return
        try:
            reply = describe() if request[0] == "describe" else _draw(files, *request)
        except Exception as error:  # noqa: BLE001 — sent back to the kernel, which raises it
            reply = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        try:
            replies.send(reply)
        except OSError:
            return


def _draw(files: dict, figure: str, events_path: str, title: str) -> tuple:
    from labkit.plots import render_png

    module, name = figure.split(":")
    make = getattr(importlib.import_module(module), name)
    events = files.setdefault(events_path, EventsFile(events_path)).read()
    while len(files) > RUNS_KEPT:
        files.pop(next(iter(files)))
    return timed(lambda: render_png(make(events, title)))


def describe() -> dict:
    """This process's priority, as the scheduler sees it."""
    policy = getattr(os, "sched_getscheduler", lambda pid: None)(0)
    return {"pid": os.getpid(), "nice": os.nice(0), "autogroup_nice": autogroup_nice(),
            "own_session": os.getsid(0) == os.getpid(), "idle_class": policy == getattr(os, "SCHED_IDLE", -1)}


BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
"""How the painter starts: this file run as a script, not ``python -m labkit.widgets.painter``, which would import
the ``labkit`` package (and torch: seconds of CPU) at normal priority, during the run, before lowering it."""


class Painter:
    """The low-priority drawing process (this file, in a session of its own: :data:`BOOT`); each request
    is answered through a future, by a daemon thread that waits for the reply (a kernel that exits never waits
    for a frame, and ends the painter on its way out)."""

    def __init__(self):
        import subprocess
        from multiprocessing.connection import Connection

        self.process = subprocess.Popen([sys.executable, "-c", BOOT, __file__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        self._send = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self._recv = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        self._lock = threading.Lock()  # one request on the pipes at a time
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.process.poll() is None

    def set_group_nice(self, value: int) -> bool:
        """The nice value of the painter's session (its autogroup); False where there are no autogroups."""
        try:
            set_autogroup_nice(value, path=Path(f"/proc/{self.process.pid}/autogroup"))
            return True
        except OSError:
            return False

    def submit(self, figure: str, events_path, title: str = "") -> Future:
        """A frame of ``figure`` (``"module:function"``) from the events in ``events_path``; the future's result
        is ``(png, cpu_s, started, ended)``."""
        future: Future = Future()
        threading.Thread(target=self._answer, args=(future, (figure, str(events_path), title)),
                         name="labkit-painter-wait", daemon=True).start()
        return future

    def describe(self) -> dict:
        return self._ask(("describe",))

    def close(self) -> None:
        """End the painter (it would end by itself on seeing its requests' pipe close, after any frame it draws)."""
        self._send.close()
        self.process.kill()
        self.process.wait()

    def _answer(self, future: Future, request: tuple) -> None:
        try:
            future.set_result(self._ask(request))
        except BaseException as error:  # noqa: BLE001 — handed to whoever reads the future
            future.set_exception(error)

    def _ask(self, request: tuple):
        with self._lock:
            self._send.send(request)
            reply = self._recv.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"the painter process failed: {reply}")
        return reply


_PAINTER: Optional[Painter] = None
_LOCK = threading.Lock()


def painter() -> Painter:
    """This process's painter, started on first use (and again if it has died)."""
    global _PAINTER
    with _LOCK:
        if _PAINTER is None or not _PAINTER.alive():
            _PAINTER = Painter()
        return _PAINTER


def main() -> None:
    """The painter process: at the lowest priority first, then serve requests from stdin, replies on stdout
    (anything the figures print goes to stderr)."""
    lower_priority()
    from multiprocessing.connection import Connection

    requests, replies = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    serve(requests, replies)


if __name__ == "__main__":
    main()
