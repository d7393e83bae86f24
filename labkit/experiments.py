"""Experiments: launch a run, wait for it to end, collect what it measured, and sweep over settings.

Every lab asks the same question of several settings — which strategy, which compressor, which
precision, which model size, which optimisation — and answers it the same way::

    for label, overrides in points:             # one setting after another, never two at once:
        run = run_to_end(config.replace(**overrides), nproc, label)   # two runs sharing the cores
        rows.append(collect(run, label, overrides))                  # would each measure the other

:func:`run_to_end` launches a run (:func:`labkit.launcher.launch`), waits for it, and raises
:class:`RunFailed` — with the tail of the run's log — unless it finished: a lab never draws a
half-finished run as if it were a result. What to *collect* from a finished run is each lab's
own business (its summary, its loss curve, its communication bytes), so :func:`sweep` takes it as
a function.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from labkit.config import Config
from labkit.launcher import Run, launch

LOG_TAIL = 2000
"""Characters of a failed run's ``launcher.log`` quoted in the error: usually the traceback."""

Progress = Optional[Callable[[str], None]]
Collect = Callable[[Run, str, dict], Any]


class RunFailed(RuntimeError):
    """A run ended other than ``finished`` (failed, stopped); the message names it and quotes its log."""


def run_to_end(config: Config, nproc: int, label: str = "run") -> Run:
    """Launch ``config`` on ``nproc`` processes and wait for it; the finished :class:`~labkit.launcher.Run`.

    Raises :class:`RunFailed` if it did not finish. A kernel interrupt while waiting stops the run
    (:meth:`Run.wait`), so no worker outlives the cell.
    """
    run = launch(config, nproc=nproc)
    status = run.wait()
    if status != "finished":
        raise RunFailed(f"run {label!r} {status}: see {run.run_dir}/launcher.log\n{run.log()[-LOG_TAIL:]}")
    return run


def sweep(config: Config, nproc: int, points: list[tuple[str, dict]], collect: Collect,
          on_progress: Progress = None) -> list:
    """One real run per ``(label, overrides)`` point, in turn; ``collect(run, label, overrides)`` of each.

    ``overrides`` are dotted config keys applied to ``config``. ``on_progress`` hears
    ``"run 2/3: label…"`` before each run and ``"done: 3 runs"`` at the end. The first run that
    does not finish raises :class:`RunFailed`; the points after it are not run.
    """
    say = on_progress or (lambda text: None)
    rows = []
    for i, (label, overrides) in enumerate(points):
        say(f"run {i + 1}/{len(points)}: {label}…")
        rows.append(collect(run_to_end(config.replace(**overrides), nproc, label), label, overrides))
    say(f"done: {len(rows)} runs")
    return rows
