"""The hang watchdog: a rank that finishes no step for ``fault.watchdog_s`` seconds ends its attempt.

A hang inside a collective is caught by the collective's own timeout (``comm.timeout_s``), which names the
operation. A rank can also stop making progress outside one — stuck in a data loader, a deadlock, a disk that
stopped answering — and then nothing times out: the other ranks wait in their next collective until *their*
timeout. The watchdog is a thread that checks the time since the loop last finished a step (the time of
evaluations and checkpoint saves included); past ``fault.watchdog_s`` it writes what it saw and ends the process,
and the elastic agent restarts the group from the newest checkpoint.

The ladder (:func:`labkit.fault.checks.timeout_ladder_problems`): ``comm.timeout_s`` < ``fault.watchdog_s`` <
``fault.rendezvous_timeout_s`` — the precise error first, the watchdog next, and the group waits longer than both
to re-form, so that a restart can still find every rank.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

WATCHDOG_EXIT_CODE = 18  # what a rank the watchdog ended exits with (an injected crash exits with 17)


class Watchdog:
    """Calls ``on_expire(seconds since the last beat)`` once, from its own thread, when :meth:`beat` has not been
    called for ``timeout_s`` seconds; :meth:`stop` ends it. ``clock`` is ``time.monotonic`` unless a test gives
    another."""

    def __init__(self, timeout_s: float, on_expire: Callable[[float], None], clock=time.monotonic,
                 poll_s: float | None = None):
        self.timeout_s, self.on_expire, self.clock = timeout_s, on_expire, clock
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.last = clock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="labkit-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.beat()
        self.thread.start()
        return self

    def beat(self) -> None:
        self.last = self.clock()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll_s):
            idle = self.clock() - self.last
            if idle > self.timeout_s:
                self.on_expire(idle)
                return
