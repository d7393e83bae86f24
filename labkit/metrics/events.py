"""Events: one JSON object per line in ``RUN_DIR/events.jsonl``.

JSON lines are the meeting point between workers and everything that watches them (the
notebook's Run handle, the CLI, later a run store): appended and flushed line by line, so a
crash loses at most the line being written, and a reader can tail the file while it grows.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from labkit.files import write_json  # noqa: F401 (events and summaries are written with it)

STEP_COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "data_s", "compute_s",
                "comm_s", "comm_exposed_s", "comm_frac", "comm_exposed_frac", "comm_bytes", "tflops", "mfu",
                "max_mem_bytes"]
"""The core columns of every step event (a run with no step yet still has them, empty). Communication
comes twice: ``comm_s``/``comm_frac`` in flight (launch to completion, overlapped or not) and
``comm_exposed_s``/``comm_exposed_frac`` exposed (what backward did not hide; None where unmeasurable)."""


def json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class EventWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, type: str, **fields: Any) -> dict:
        event = json_safe({"type": type, "time": time.time(), **fields})
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()


def first_event_time(path: str | Path, default: float) -> float:
    """When the first event was written (a restarted run's start), reading one line only."""
    try:
        with open(path) as f:
            return float(json.loads(f.readline())["time"])
    except (OSError, ValueError, KeyError):
        return default


class EventHistory:
    """A run's events as a watcher holds them, in bounded memory however long the run.

    Every event is kept until ``capacity`` are held. Then the older half's step events are thinned to
    every other one; the newest half stays whole, and every non-step event (start, alerts, faults,
    checkpoints, evaluations, end) is kept. A long run's curves keep their shape, at a resolution that
    halves the further back they go; the newest steps are all there.
    """

    def __init__(self, capacity: int = 4000):
        if capacity < 2:
            raise ValueError(f"an event history holds at least 2 events, not {capacity}")
        self.capacity = capacity
        self._events: list[dict] = []

    def __len__(self) -> int:
        return len(self._events)

    def extend(self, events: list[dict]) -> None:
        self._events.extend(events)
        while len(self._events) > self.capacity and self._thin_older_half():
            pass

    def _thin_older_half(self) -> bool:
        """Drop every other step event of the older half; False when nothing was left to drop."""
        half = len(self._events) // 2
        older, newer = self._events[:half], self._events[half:]
        kept, nth_step = [], 0
        for event in older:
            if event.get("type") == "step":
                nth_step += 1
                if nth_step % 2 == 0:
                    continue
            kept.append(event)
        self._events = kept + newer
        return len(kept) < len(older)

    def snapshot(self) -> list[dict]:
        """The events held, oldest first (a copy of at most about ``capacity`` references)."""
        return list(self._events)


def read_events(path: str | Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete lines from byte ``offset`` on; returns the events and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # ignore a line still being written
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def final_trajectory(events) -> list[dict]:
    """The step events (of a run's ``events``) of the trajectory that made the model, in order.

    After a restart the resumed attempt recomputes the steps since its checkpoint and logs them
    again; ``events.jsonl`` keeps both attempts (what happened), but a curve of loss against step
    should show each step once, as the attempt that carried on computed it. Each step event drops
    the earlier ones at or after its step.
    """
    kept: list[dict] = []
    for event in (e for e in events if e.get("type") == "step" and "step" in e):
        while kept and kept[-1]["step"] >= event["step"]:
            kept.pop()
        kept.append(event)
    return kept


STOP_REQUEST = "stop_requested.json"


def request_stop(run_dir: str | Path) -> None:
    """Mark a run as stopped on purpose, before any signal: a worker that then sees its peers vanish
    reports ``stopped``, not ``failed``, and the elastic agent does not restart it."""
    write_json(Path(run_dir) / STOP_REQUEST, {"time": time.time()})


def stop_requested(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STOP_REQUEST).exists()


def as_requested_stop(summary: dict, run_dir: str | Path) -> dict:
    """A failure during a requested stop is the stop itself: say so, and keep what the worker saw."""
    if summary.get("status") == "failed" and stop_requested(run_dir):
        summary.update(status="stopped", error=f"stopped on request (a worker then saw: {summary.get('error')})")
    return summary


def attempt_ends_early(summary: dict, run_dir: str | Path, attempt: int, max_restarts: int) -> bool:
    """Settle how this attempt ended (see :func:`as_requested_stop`); True if the elastic agent will
    start another one: it did not finish, nobody asked it to stop, and restarts are left."""
    as_requested_stop(summary, run_dir)
    return summary["status"] != "finished" and not stop_requested(run_dir) and attempt < max_restarts
