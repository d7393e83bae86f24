"""A window of step events, summed up one way for every reader: the run's summary and a dashboard's headline.

A step event holds per-step numbers: a rate (tokens/s), a share of the step's time (communication in flight), seconds.
Over many steps, averaging the rates would let a slow step count as much as a fast one, however long it lasted;
so a window's **rate** is its total work over its total time (the harmonic mean of its steps' rates, every step of a
run doing the same work), its **share** of step time is the seconds summed over the steps' time summed, and its
**seconds** per step a plain mean (:class:`Window`). The summary applies it to an attempt's steady-state steps
(:func:`steady_means`: the warm-up left out), a live headline to the last few steps, and once a run has ended a
headline to the summary's own window (:func:`headline_window`), so the two never disagree.
"""
from __future__ import annotations

from labkit.metrics.communication import exposed_frac
from labkit.metrics.events import final_trajectory

SUMMARY_MEANS = ["tokens_per_s", "step_time_s", "comm_s", "comm_exposed_s", "comm_frac", "comm_exposed_frac", "tflops",
                 "mfu", "model_comm_frac", "pipeline_idle"]
"""What a run's summary averages over its steady-state steps, each by :func:`window_means`' definition."""
RATES = ("tokens_per_s", "tflops", "mfu")
"""Work per second of a step (every step of a run does the same work): over many steps, total work / total time."""
SHARES = ("comm_frac", "comm_exposed_frac", "model_comm_frac", "pipeline_idle")
"""Shares of a step's time: over many steps, their seconds summed over the steps' time summed."""
WARMUP_SKIP = 3  # steps left out of the averages (compilation, caches), or a quarter of a shorter run


def warmup_skip(count: int) -> int:
    """How many first steps of ``count`` the summary leaves out: WARMUP_SKIP, or a quarter of a shorter run."""
    return min(WARMUP_SKIP, count // 4)


def _value(event: dict, key: str):
    return exposed_frac(event) if key == "comm_exposed_frac" else event.get(key)


class Window:
    """Running sums that give a window of steps' numbers (rates, shares, seconds: see the module's docstring), in
    constant memory however many steps."""

    def __init__(self):
        self.totals = {key: 0.0 for key in SUMMARY_MEANS}
        self.weights = {key: 0.0 for key in SUMMARY_MEANS}

    def add(self, event: dict) -> None:
        step_s = event.get("step_time_s") or 1.0  # synthetic events without a time weigh alike
        for key in SUMMARY_MEANS:
            value = _value(event, key)
            if value is None or (key in RATES and value <= 0):
                continue
            if key in RATES:
                self.totals[key] += 1.0 / value  # seconds per unit of work, up to the (constant) work per step
                self.weights[key] += 1.0
            elif key in SHARES:
                self.totals[key] += value * step_s
                self.weights[key] += step_s
            else:
                self.totals[key] += value
                self.weights[key] += 1.0

    def means(self) -> dict:
        def mean(key):
            if not self.weights[key]:
                return None
            return self.weights[key] / self.totals[key] if key in RATES else self.totals[key] / self.weights[key]

        return {key: mean(key) for key in SUMMARY_MEANS}


def window_means(steps: list[dict]) -> dict:
    """The numbers of a window of step events (see :class:`Window`)."""
    window = Window()
    for event in steps:
        window.add(event)
    return window.means()


def summarize(events: list[dict], skip: int) -> dict:
    """A run's numbers over its steady-state steps (the first ``skip`` steps include warm-up costs)."""
    return window_means(events[skip:] or events)


def steady_means(steps: list[dict]) -> dict:
    """What the run's summary says for an attempt whose step events are ``steps``: the warm-up left out."""
    return summarize(steps, warmup_skip(len(steps)))


def last_attempt(events: list[dict]) -> list[dict]:
    """The step events of a run's last attempt (after its last start event): what its summary averages."""
    starts = [i for i, e in enumerate(events) if e.get("type") == "start"]
    return [e for e in events[starts[-1] if starts else 0:] if e.get("type") == "step"]


def headline_window(events: list[dict], last: int) -> tuple[str, dict]:
    """A watcher's window on a run's events, named, and its numbers by the summary's definition: while the run
    goes, its ``last`` steps; once it has ended, the steps its summary averages (the last attempt past its
    warm-up), so a headline then says what ``summary.json`` says."""
    steps = last_attempt(events)
    if steps and any(e.get("type") == "end" for e in events):
        first = steps[warmup_skip(len(steps))]["step"] + 1
        return f"steps {first}–{steps[-1]['step'] + 1} (the run's summary)", steady_means(steps)
    recent = final_trajectory(events)[-last:]
    return f"last {len(recent)} steps", window_means(recent)


