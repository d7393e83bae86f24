"""Recorded runs, replayed: a dashboard demo at slide speed in a room without the time or the cores to train.

A recording is a real run's directory trimmed to what the dashboards read (``events.jsonl``, shipped gzipped as
``events.jsonl.gz``; ``summary.json``, ``config.json``, and ``faults.jsonl`` for a run that was killed) plus
``meta.json``: the machine it ran on and when. ``datasets/recorded_runs/record.py`` makes them; :func:`replay`
plays one back::

    run = labkit.replay("quickstart", speed=8)     # 8× faster than it trained
    RunDashboard().follow(run)                     # the same dashboard as for a live run

A :class:`RecordedRun` answers what a live :class:`~labkit.launcher.Run` answers (``events()``, ``status``,
``summary``, ``metrics``, ``run_dir``, ``wait()``, ``stop()``). Each event is released when its own
timestamp, measured from the first event and divided by ``speed``, has passed on the clock; released events
are appended to ``run_dir/events.jsonl``, a fresh temporary directory, because a dashboard's painter process
reads that file from disk. The shipped files are never written. Until the last event is out the status is
``running``; then it is the recorded one, and ``summary.json`` appears, as it does when a live run ends, with
any folder of a lab's own records the recording holds (``cap/``: a consistency run's per-worker progress and
server updates, which notebook 01 draws).
Nothing is ever invented: a replay shows the recorded numbers of the recorded machine, and says so
(:attr:`RecordedRun.label`, which the dashboard puts in its headline and picture).
"""
from __future__ import annotations

import gzip
import json
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable, Optional, Union

from labkit.metrics.events import STEP_COLUMNS, final_trajectory

RECORDINGS_DIR = Path(__file__).resolve().parents[1] / "datasets" / "recorded_runs"
COPIED = ("config.json", "launch.json")  # what a run directory holds from its start


def recording_dir(name_or_path: Union[str, Path]) -> Path:
    """A shipped recording's name (``"quickstart"``) or any directory that holds a recording."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    shipped = RECORDINGS_DIR / str(name_or_path)
    if shipped.is_dir():
        return shipped
    raise FileNotFoundError(f"no recording at {path} nor {shipped}; shipped recordings: "
                            f"{', '.join(shipped_names()) or 'none'}")


def events_file(recording: Path) -> Path:
    """A recording's events: ``events.jsonl``, or gzipped, ``events.jsonl.gz`` (how the shipped ones are stored)."""
    for name in ("events.jsonl", "events.jsonl.gz"):
        if (recording / name).exists():
            return recording / name
    raise FileNotFoundError(f"{recording}: a recording needs its events (events.jsonl or events.jsonl.gz)")


def load_events(path: Path) -> list[dict]:
    """Every event of a recorded JSON-lines file (gzipped if its name ends in .gz), strictly: a garbled line is an
    error naming the file and the line (a live run's reader skips a half-written last line; a recording has none)."""
    try:
        text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        lines = text.decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: unreadable ({error})") from None
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not a JSON event ({error})") from None
        if not isinstance(event, dict) or not isinstance(event.get("time"), (int, float)) or "type" not in event:
            raise ValueError(f"{path}:{number}: an event needs a type and a numeric time")
        events.append(event)
    if not events:
        raise ValueError(f"{path}: no events recorded")
    return events


def load_json(path: Path, required: bool = True) -> Optional[dict]:
    """A recording's JSON file (``None`` for a missing optional one); unreadable: an error naming it."""
    if not path.exists():
        if required:
            raise FileNotFoundError(f"{path}: missing from the recording")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def short_machine(meta: dict) -> str:
    """The machine of ``meta.json`` in a few words: its CPU and cores, and its GPU if it had one."""
    machine = meta.get("machine") or {}
    if isinstance(machine, str):
        return machine
    words = f"{machine.get('cpu', 'an unknown CPU')} ({machine.get('cores', '?')} cores)"
    return words + (f", {machine['gpu']}" if machine.get("gpu") else "")


def fresh_run_dir(recording: Path) -> Path:
    """A new temporary run directory holding what a run's directory holds from its start (its config)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"labkit-replay-{recording.name}-"))
    for name in COPIED:
        if (recording / name).exists():
            shutil.copy2(recording / name, run_dir / name)
    return run_dir


class RecordedRun:
    """A recorded run played back in time, with the interface of a live :class:`~labkit.launcher.Run`.

    ``speed``: how many recorded seconds pass per second of replay (``None``: everything at once).
    ``clock`` and ``sleep`` default to the real ones; a test passes a fake pair to step time by hand.
    """

    def __init__(self, source: Union[str, Path], speed: Optional[float] = 10.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if speed is not None and not speed > 0:
            raise ValueError(f"speed is how many times faster than recorded, a positive number, not {speed}")
        self.source = recording_dir(source)
        self._recorded = load_events(events_file(self.source))
        self._recorded_summary = load_json(self.source / "summary.json")
        faults = self.source / "faults.jsonl"
        self._faults = sorted(load_events(faults), key=lambda f: f["time"]) if faults.exists() else []
        self.meta = load_json(self.source / "meta.json", required=False) or {}
        self.speed, self._clock, self._sleep = speed, clock, sleep
        self.nproc = self.meta.get("nproc", 1)
        self.run_dir = fresh_run_dir(self.source)
        self._remove_run_dir = weakref.finalize(self, shutil.rmtree, self.run_dir, True)  # at exit at the latest
        self._released = self._faults_out = 0
        self._stopped = False
        self._started = clock()
        self._release()

    def __repr__(self) -> str:
        return f"RecordedRun({str(self.source)!r}, speed={self.speed}, status={self.status!r})"

    # ---------------------------------------------------------------- what it says it is
    @property
    def label(self) -> str:
        """What a screen must say: a recording, of which machine, when, and how fast it is played."""
        date = str(self.meta.get("date", "an unknown date"))[:10]
        pace = "all at once" if self.speed is None else f"×{self.speed:g}"
        return f"recorded on {short_machine(self.meta)}, {date} — replay {pace}"

    # ---------------------------------------------------------------- playing
    def _due(self, event: dict, first: dict) -> float:
        """Seconds of replay after the start at which ``event`` is released."""
        return 0.0 if self.speed is None else (event["time"] - first["time"]) / self.speed

    def _release(self) -> None:
        """Append to ``run_dir`` every event (and fault record) whose time has come; at the end, the summary."""
        if self._stopped or self._released == len(self._recorded):
            return
        elapsed, first = self._clock() - self._started, self._recorded[0]
        end = self._released
        while end < len(self._recorded) and self._due(self._recorded[end], first) <= elapsed:
            end += 1
        if end > self._released:
            self._append("events.jsonl", self._recorded[self._released:end])
            horizon = self._recorded[end - 1]["time"]  # a fault record goes out with the first event after it
            faults = [f for f in self._faults[self._faults_out:] if f["time"] <= horizon]
            self._append("faults.jsonl", faults)
            self._released, self._faults_out = end, self._faults_out + len(faults)
        if self._released == len(self._recorded):
            for folder in (p for p in self.source.iterdir() if p.is_dir()):  # a lab's own records (cap/)
                shutil.copytree(folder, self.run_dir / folder.name, dirs_exist_ok=True)
            shutil.copy2(self.source / "summary.json", self.run_dir / "summary.json")  # as the run wrote it

    def _append(self, name: str, events: list[dict]) -> None:
        if events:
            with open(self.run_dir / name, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(event) + "\n" for event in events))

    def _seconds_to_next(self) -> float:
        """Replay seconds until the next event is due (0 if it is already)."""
        due = self._due(self._recorded[self._released], self._recorded[0])
        return max(0.0, due - (self._clock() - self._started))

    # ---------------------------------------------------------------- a Run's interface
    def events(self) -> list[dict]:
        """The events released so far, oldest first (a copy)."""
        self._release()
        return list(self._recorded[:self._released])

    @property
    def metrics(self) -> dict[str, list]:
        """Step events as columns, the final trajectory's (as :attr:`labkit.launcher.Run.metrics`)."""
        steps = final_trajectory(self.events())
        keys = [k for k in steps[0] if k != "type"] if steps else STEP_COLUMNS
        return {k: [e.get(k) for e in steps] for k in keys}

    @property
    def status(self) -> str:
        """``running`` until the last recorded event is released, then the recorded status (``stopped`` if
        :meth:`stop` ended the replay first)."""
        self._release()
        if self._released == len(self._recorded):
            return self._recorded_summary.get("status", "unknown")
        return "stopped" if self._stopped else "running"

    @property
    def summary(self) -> Optional[dict]:
        """The recorded ``summary.json`` once the replay has reached the end; ``None`` before, as for a live run."""
        return dict(self._recorded_summary) if self.status not in ("running", "stopped") else None

    def wait(self, timeout: Optional[float] = None) -> str:
        """Sleep until the replay ends (or ``timeout`` seconds of the clock pass); returns the status."""
        deadline = None if timeout is None else self._clock() + timeout
        while self.status == "running":
            left = self._seconds_to_next()
            if deadline is not None:
                left = min(left, deadline - self._clock())
                if left <= 0:
                    break
            self._sleep(min(max(left, 0.001), 0.5))
        return self.status

    def stop(self, grace_s: float = 0.0) -> str:
        """End the replay where it is: no more events are released; the status says ``stopped``."""
        self._release()
        self._stopped = True
        return self.status

    def log(self) -> str:
        """There is no console output to show, only where the recording came from."""
        return f"replay of {self.source} ({self.label})"

    def cleanup(self) -> None:
        """Remove the temporary run directory now (otherwise: once the replay is forgotten, or at exit)."""
        self._remove_run_dir()


def replay(source: Union[str, Path], speed: Optional[float] = 10.0, **clock) -> RecordedRun:
    """Play a recorded run back ``speed`` times faster than it trained (``None``: all at once); see the module."""
    return RecordedRun(source, speed=speed, **clock)


def shipped_names() -> list[str]:
    """The names of the recordings in ``datasets/recorded_runs/``."""
    if not RECORDINGS_DIR.is_dir():
        return []
    return sorted(p.name for p in RECORDINGS_DIR.iterdir() if any(p.glob("events.jsonl*")))
