"""One worker process: what ``python -m labkit train …`` runs on each rank, under torchrun or labkit's launcher.

It trains (:func:`labkit.train.train`) and leaves cleanly: SIGTERM from the elastic agent becomes
:class:`~labkit.session.Stopped` (exit code 143) and the Ctrl-C it passes on ``KeyboardInterrupt``, each noted first
(:func:`~labkit.session.stop_on_signal`: the summary says stopped even where torch turns the exception into an
error), a worker whose launcher died exits by itself, and a pid file says which process is which rank while it runs.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.config import Config
from labkit.session import Stopped, note_stop_signal, stop_on_signal
from labkit.train import train


@record  # a failure's message goes to the elastic agent's error file: the run's summary can say why
def worker_main(cfg: Config, run_dir: str | Path) -> int:
    """Entry point of one worker process (under torchrun or labkit's launcher), given its parsed config."""
    from labkit.launcher import exit_when_orphaned, remove_pid_file, write_pid_file

    signal.signal(signal.SIGTERM, stop_on_signal)  # the elastic agent's stop, and the Ctrl-C it passes on:
    signal.signal(signal.SIGINT, stop_on_signal)  # noted, so a stop that torch turns into an error still says stopped
    exit_when_orphaned()
    run_dir = Path(run_dir)
    pid_file = write_pid_file(run_dir / "pids", os.environ.get("RANK", "0"))  # pid and start time
    code = 0
    try:
        train(cfg, run_dir)
    except Stopped:
        code = 143
    finally:  # on the way out: a stop now is only noted, so torch's error file (@record) is written whole
        signal.signal(signal.SIGTERM, note_stop_signal)
        signal.signal(signal.SIGINT, note_stop_signal)
        remove_pid_file(pid_file)
    # Everything is written and closed. Leave without running C++ static destructors, which can
    # race with the communication backend's threads and abort a process that finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
