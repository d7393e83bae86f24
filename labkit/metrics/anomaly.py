"""Anomaly detection on step events: layer 3 of monitoring.

Layer 1 (``events.jsonl``, the progress bar) shows one run as it happens; layer 2 (the run
store) remembers many runs. Layer 3 watches a run *for* you and says when something changed:
the run got slower, one rank fell behind, the loss jumped, memory keeps growing.

Every detector compares the newest step with a rolling baseline of the steps before it. The
baseline is a **median**, not a mean: one slow step (a checkpoint, a garbage collection) drags a
mean but leaves a median alone. Spread is the **median absolute deviation** (MAD) for the same
reason; for gaussian noise 1.4826 × MAD estimates the standard deviation.

Two rules keep alerts worth reading:

* **Warm-up.** The first ``warmup_steps`` steps pay for compilation, allocator growth and cold
  caches; they are neither judged nor put into any baseline. A non-finite loss is the exception:
  compilation does not make a loss NaN, so that alert fires from the first step.
* **One incident, one alert.** After a detector fires it stays silent until its condition has
  been clear for ``cooldown_steps`` steps, so a slowdown lasting 40 steps is one alert, not 40.

Every step joins the baseline, anomalous or not: a lasting change becomes the new normal after
about ``window / 2`` steps. The monitor reports *changes*; a state that never changes (a run
that is slow from its first step) is the optimiser's business (``labkit.tuning``).

Detectors only observe: they return :class:`Alert` objects and never touch the run. What to do
next — profile (:func:`diagnosis_request`), stop, or shrug — is decided elsewhere.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from itertools import pairwise
from pathlib import Path

NORMAL_MAD = 1.4826
"""1.4826 × MAD estimates σ for gaussian noise, so a robust z-score reads like an ordinary one."""
MEMORY_MIN_RISES = 0.25
"""A leak raises the peak step after step; one bigger allocation raises it once. Memory growth
counts only when the peak rose in at least this fraction of the window's steps."""
KINDS = ("throughput_drop", "step_time_spike", "straggler", "loss_spike", "loss_nonfinite",
         "comm_frac_jump", "memory_growth")


@dataclass
class AnomalyThresholds:
    """When a step counts as anomalous. Every field can come from a config; ``validate`` checks ranges."""

    window: int = 50  # steps in the rolling baseline
    min_baseline: int = 20  # steps of baseline before a detector judges: a MAD of 8 noisy numbers can be 3× too small
    warmup_steps: int = 10  # steps never judged (compilation, caches)
    cooldown_steps: int = 20  # quiet steps before the same detector may fire again
    throughput_drop: float = 0.30  # alert when tokens/s < (1 - x) × baseline
    sustain_steps: int = 3  # throughput, communication: judged on the median of the newest steps (a blip isn't a shift)
    step_time_factor: float = 2.0  # step time > k × baseline median ...
    step_time_z: float = 5.0  # ... and more than z robust standard deviations above it
    straggler_factor: float = 0.5  # a rank slower than (1 + x) × the median of the other ranks ...
    straggler_steps: int = 3  # ... for this many consecutive steps
    loss_mads: float = 10.0  # loss > median + k × MAD
    comm_frac_jump: float = 0.15  # exposed communication share above baseline + x (absolute: 0.15 = 15 points)
    memory_growth: float = 0.10  # peak memory grew by more than x over memory_window steps
    memory_window: int = 50

    def validate(self) -> None:
        """Raise ``ValueError`` naming every out-of-range threshold and its allowed range."""
        problems = []

        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                problems.append(f"{name}={getattr(self, name)!r}: must be {allowed}")

        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"{f.name}={value!r}: must be a finite number")
        if problems:
            raise ValueError("invalid anomaly thresholds:\n" + "\n".join(f"  - {p}" for p in problems))
        check("window", self.window >= 2, "an integer >= 2 (a baseline needs at least two steps)")
        check("memory_window", self.memory_window >= 2, "an integer >= 2")
        check("min_baseline", 2 <= self.min_baseline <= self.window, f"between 2 and window ({self.window})")
        check("warmup_steps", self.warmup_steps >= 0, ">= 0")
        check("cooldown_steps", self.cooldown_steps >= 0, ">= 0")
        check("sustain_steps", 1 <= self.sustain_steps <= self.window, f"between 1 and window ({self.window})")
        check("straggler_steps", self.straggler_steps >= 1, ">= 1")
        check("throughput_drop", 0 < self.throughput_drop < 1, "a fraction in (0, 1): 0.3 means 30% slower")
        check("comm_frac_jump", 0 < self.comm_frac_jump <= 1, "a fraction in (0, 1]: 0.15 means +15 points")
        check("memory_growth", self.memory_growth > 0, "> 0: 0.1 means 10% growth")
        check("straggler_factor", self.straggler_factor > 0, "> 0: 0.5 means 1.5× the other ranks")
        check("step_time_factor", self.step_time_factor > 1, "> 1: 2.0 means twice the median")
        check("step_time_z", self.step_time_z > 0, "> 0")
        check("loss_mads", self.loss_mads > 0, "> 0")
        if problems:
            raise ValueError("invalid anomaly thresholds:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Alert:
    """One anomaly. ``threshold`` is the boundary in ``value``'s units (where the detector starts to fire)."""

    kind: str
    step: int
    rank: int | None
    value: float | None
    baseline: float | None
    threshold: float | None
    message: str  # one line, readable on a projector


# ---------------------------------------------------------------- robust statistics and formatting

def mad(values: list[float], center: float) -> float:
    """Median absolute deviation around ``center``, floored so a perfectly flat baseline is not infinitely sure."""
    return max(statistics.median(abs(v - center) for v in values), 1e-3 * abs(center), 1e-12)


def robust_z(value: float, values: list[float]) -> float:
    center = statistics.median(values)
    return (value - center) / (NORMAL_MAD * mad(values, center))


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def rank_busy_times(event: dict) -> tuple[list[float] | None, str]:
    """Per-rank time to compare for stragglers, and what it is called.

    Under synchronous data parallelism every rank's *step time* is about the same: the fast ranks
    wait for the slow one inside the all-reduce. The difference shows in the time outside
    communication, so when per-rank ``comm_s`` is known the detector uses step time − comm time.
    """
    ranks = event.get("ranks") or {}
    times = event.get("rank_step_time_s") or ranks.get("step_time_s")
    comm = event.get("rank_comm_s") or ranks.get("comm_s")
    if not times or not all(finite(t) for t in times):
        return None, ""
    if comm and len(comm) == len(times) and all(finite(c) for c in comm):
        return [t - c for t, c in zip(times, comm)], "time outside communication"
    return list(times), "step time"


# ---------------------------------------------------------------- the monitor

class AnomalyMonitor:
    """Feed it events one at a time (``observe``) or a finished run's at once (``scan``)."""

    def __init__(self, thresholds: AnomalyThresholds | None = None):
        self.thresholds = thresholds or AnomalyThresholds()
        self.thresholds.validate()
        self.reset()

    def reset(self) -> None:
        """Forget everything: a restarted worker compiles and warms its caches again."""
        t = self.thresholds
        self.first_step: int | None = None
        self.history = {key: deque(maxlen=t.window + t.sustain_steps)
                        for key in ("tokens_per_s", "step_time_s", "loss", "comm_frac", "comm_exposed_frac")}
        self.memory: deque = deque(maxlen=t.memory_window)
        self.slow_streak: dict[int, int] = {}
        self.last_firing: dict[tuple[str, int | None], int] = {}  # (kind, rank) → last step its condition held

    def scan(self, events: Iterable[dict]) -> list[Alert]:
        self.reset()
        return [alert for event in events for alert in self.observe(event)]

    def observe(self, event: dict) -> list[Alert]:
        if event.get("type") == "start":
            self.reset()
        if event.get("type", "step") != "step" or "step" not in event:
            return []
        step = int(event["step"])
        self.first_step = step if self.first_step is None else self.first_step
        found = [self._nonfinite_loss(event, step)]
        if step - self.first_step >= self.thresholds.warmup_steps:
            found += [self._throughput_drop(event, step), self._step_time_spike(event, step),
                      self._loss_spike(event, step), self._comm_frac_jump(event, step),
                      self._memory_growth(event, step), *self._stragglers(event, step)]
            self._remember(event)
        return [alert for alert in found if alert is not None and self._first_of_incident(alert)]

    def _first_of_incident(self, alert: Alert) -> bool:
        key = (alert.kind, alert.rank)
        previous = self.last_firing.get(key)
        self.last_firing[key] = alert.step
        return previous is None or alert.step - previous > self.thresholds.cooldown_steps

    def _remember(self, event: dict) -> None:
        for key, values in self.history.items():
            if finite(event.get(key)):
                values.append(float(event[key]))
        if finite(event.get("max_mem_bytes")):
            self.memory.append(float(event["max_mem_bytes"]))

    def _baseline(self, key: str, skip_newest: int = 0) -> list[float] | None:
        values = list(self.history[key])
        values = values[:len(values) - skip_newest][-self.thresholds.window:]
        return values if len(values) >= self.thresholds.min_baseline else None

    def _sustained(self, key: str, value) -> tuple[float, list[float]] | None:
        """(median of the newest ``sustain_steps`` values, the baseline before them), or None."""
        earlier = self.thresholds.sustain_steps - 1
        base = self._baseline(key, skip_newest=earlier)
        if not finite(value) or base is None:
            return None
        history = list(self.history[key])
        return statistics.median(history[len(history) - earlier:] + [value]), base

    # ------------------------------------------------------------ detectors: an Alert or None

    def _nonfinite_loss(self, event: dict, step: int) -> Alert | None:
        if "loss" not in event or finite(event["loss"]):
            return None
        return Alert("loss_nonfinite", step, None, None, None, None,
                     f"step {step}: loss is NaN or infinite — the run diverged or overflowed; "
                     "steps after this one are not meaningful")

    def _throughput_drop(self, event: dict, step: int) -> Alert | None:
        t = self.thresholds
        found = self._sustained("tokens_per_s", event.get("tokens_per_s"))
        if found is None:
            return None
        recent, baseline = found[0], statistics.median(found[1])
        limit = (1 - t.throughput_drop) * baseline
        if recent >= limit:
            return None
        return Alert("throughput_drop", step, None, recent, baseline, limit,
                     f"step {step}: throughput dropped to {recent:,.0f} tokens/s, {1 - recent / baseline:.0%} "
                     f"below the {baseline:,.0f} tokens/s baseline (threshold {t.throughput_drop:.0%})")

    def _step_time_spike(self, event: dict, step: int) -> Alert | None:
        t = self.thresholds
        value, base = event.get("step_time_s"), self._baseline("step_time_s")
        if not finite(value) or base is None:
            return None
        baseline = statistics.median(base)
        limit = t.step_time_factor * baseline
        if value <= limit or robust_z(value, base) <= t.step_time_z:
            return None
        return Alert("step_time_spike", step, None, value, baseline, limit,
                     f"step {step}: step time spiked to {ms(value)}, {value / baseline:.1f}× the "
                     f"{ms(baseline)} median (threshold {t.step_time_factor:g}×)")

    def _stragglers(self, event: dict, step: int) -> list[Alert | None]:
        t = self.thresholds
        times, what = rank_busy_times(event)
        if times is None or len(times) < 2:
            return []
        alerts = []
        for rank, mine in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            limit = (1 + t.straggler_factor) * others
            self.slow_streak[rank] = self.slow_streak.get(rank, 0) + 1 if mine > limit else 0
            if self.slow_streak[rank] >= t.straggler_steps:
                alerts.append(Alert("straggler", step, rank, mine, others, limit,
                                    f"step {step}: rank {rank} is a straggler — {ms(mine)} vs {ms(others)} "
                                    f"median of the others ({what}; threshold {1 + t.straggler_factor:g}×, "
                                    f"{self.slow_streak[rank]} steps in a row)"))
        return alerts

    def _loss_spike(self, event: dict, step: int) -> Alert | None:
        t = self.thresholds
        value, base = event.get("loss"), self._baseline("loss")
        if not finite(value) or base is None:
            return None
        baseline = statistics.median(base)
        spread = mad(base, baseline)
        limit = baseline + t.loss_mads * spread
        if value <= limit:
            return None
        return Alert("loss_spike", step, None, value, baseline, limit,
                     f"step {step}: loss spiked to {value:.3f} vs a {baseline:.3f} median "
                     f"(+{(value - baseline) / spread:.0f} MADs; threshold {t.loss_mads:g})")

    def _comm_frac_jump(self, event: dict, step: int) -> Alert | None:
        """A jump in *exposed* communication: what the step waits for, so what costs time. Communication
        in flight can grow behind backward for free (or by waiting for a straggler, which has its own
        detector); it is judged only where exposed time is not measured (``fsdp2``), and said so."""
        t = self.thresholds
        exposed = finite(event.get("comm_exposed_frac"))
        key = "comm_exposed_frac" if exposed else "comm_frac"
        found = self._sustained(key, event.get(key))
        if found is None:
            return None
        recent, baseline = found[0], statistics.median(found[1])
        limit = baseline + t.comm_frac_jump
        if recent <= limit:
            return None
        in_flight = event.get("comm_frac")
        if exposed:
            what = "exposed communication (what backward did not hide)"
            context = f"; in flight {in_flight:.0%}" if finite(in_flight) else ""
        else:
            what, context = "communication in flight", "; exposed time not measured for this strategy"
        return Alert("comm_frac_jump", step, None, recent, baseline, limit,
                     f"step {step}: {what} took {recent:.0%} of the step vs {baseline:.0%} before "
                     f"(threshold +{t.comm_frac_jump * 100:.0f} points{context})")

    def _memory_growth(self, event: dict, step: int) -> Alert | None:
        t = self.thresholds
        value = event.get("max_mem_bytes")
        window = list(self.memory)[1:] + [value] if len(self.memory) == t.memory_window else None
        if not finite(value) or window is None or window[0] <= 0:
            return None
        pairs = list(pairwise(window))
        growth = window[-1] / window[0] - 1
        rises = sum(b > a for a, b in pairs)
        if any(b < a for a, b in pairs) or growth <= t.memory_growth or rises < MEMORY_MIN_RISES * len(pairs):
            return None
        return Alert("memory_growth", step, None, window[-1], window[0], window[0] * (1 + t.memory_growth),
                     f"step {step}: peak memory grew {growth:.0%} over the last {t.memory_window} steps "
                     f"({gigabytes(window[0])} → {gigabytes(window[-1])}; threshold {t.memory_growth:.0%}) "
                     "— a leak?")


def scan(events: Iterable[dict], thresholds: AnomalyThresholds | None = None) -> list[Alert]:
    """Every alert of a finished run's events, in order."""
    return AnomalyMonitor(thresholds).scan(events)


def scan_run(run_dir: str | Path, thresholds: AnomalyThresholds | None = None) -> list[Alert]:
    from labkit.metrics.events import read_events

    return scan(read_events(Path(run_dir) / "events.jsonl")[0], thresholds)


# ---------------------------------------------------------------- what to look at next

def diagnosis_request(alert: Alert, world_size: int | None = None, steps: int = 5) -> dict:
    """What a profiler should capture to explain ``alert`` (the trainer decides whether and when).

    Profiling costs time and produces big traces, so capture a few steps, on the ranks that
    matter: a straggler next to a healthy rank (the difference *is* the diagnosis); a slowdown or
    a communication jump on every rank. A loss problem is numerical, not a performance problem: a
    profile would not explain it, so none is requested. ``warmup_steps`` and ``steps`` map onto
    ``torch.profiler.schedule(wait=0, warmup=..., active=...)`` from ``start_step`` on.
    """
    request = {"kind": alert.kind, "alert_step": alert.step, "profile": True, "start_step": alert.step + 1,
               "warmup_steps": 1, "steps": steps, "ranks": "all", "record_shapes": True,
               "profile_memory": False, "focus": "compute and communication",
               "why": "find the ops (or the gaps between them) that take longer than before"}
    if alert.kind == "straggler":
        healthy = [] if world_size is not None and world_size < 2 else [1 if alert.rank == 0 else 0]
        request.update(ranks="all" if alert.rank is None else [alert.rank, *healthy], focus="compute",
                       why=f"compare rank {alert.rank}'s trace with a healthy rank's: the ops that take longer "
                           "there (or a gap where it waits on data or the host) are the cause")
    elif alert.kind == "comm_frac_jump":
        request.update(focus="communication",
                       why="see which collectives grew and whether they still overlap with backward")
    elif alert.kind == "memory_growth":
        request.update(profile_memory=True, steps=max(steps, 3), focus="memory",
                       why="record allocations over a few steps to see which tensors are never freed")
    elif alert.kind in ("loss_spike", "loss_nonfinite"):
        request.update(profile=False, ranks=[], steps=0, focus="numerics",
                       why="a loss problem is numerical: look at grad_norm, the learning rate and the batch "
                           "at that step, not at a performance trace")
    return request


def threshold_problems(thresholds: AnomalyThresholds, prefix: str = "metrics.anomaly.") -> list[str]:
    """:meth:`AnomalyThresholds.validate`'s complaints as config problems, one per threshold."""
    try:
        thresholds.validate()
    except ValueError as error:
        return [f"{prefix}{line.strip()[2:]}" for line in str(error).splitlines()[1:]]
    return []
