"""The optimisation loop, run for real: measure, find the bottleneck, try a fix, keep it only if it helped.

:mod:`labkit.tuning.flowchart` holds the flowchart's decisions as pure functions; this module walks
the flowchart with real runs (:func:`labkit.experiments.run_to_end`). One pass::

    measure the baseline (``repeats`` short runs: their spread is the noise to beat)
    node = classify(baseline)                       # (exposed-)communication- / compute-bound / utilisation ok
    while node:
        for each candidate of the node not yet tried:
            unavailable, or the config is invalid  → a skipped Decision, with the reason
            otherwise measure the trial the same way → accept()? keep it: it becomes the baseline
        node = next_node(node)                      # kernels and compilation, then done
    record the best config

Every step — kept, rejected or skipped — becomes a :class:`~labkit.tuning.flowchart.Decision`, handed to
``on_decision`` as it happens, so a notebook can draw the walk live. Nothing is kept on faith:
``accept`` refuses any change that measured slower (or not faster beyond the noise), because a
change that "should" help — a compiler, a fused kernel — can make a given machine slower.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.config import Config, ConfigError, max_procs, resolve_device
from labkit.validation import validate
from labkit.experiments import RunFailed, run_to_end
from labkit.tuning.flowchart import (
    LAUNCH_KEYS,
    NODES,
    Candidate,
    Decision,
    Measurement,
    Thresholds,
    accept,
    best_config_yaml,
    candidate_actions,
    classify,
    flatten,
    next_node,
)

MEASURE = "measure"
RECORD_BEST = "record_best"
"""Flowchart nodes that are not decisions: where the walk starts, and where it ends."""

Measurer = Callable[[Config, int, int], "tuple[Measurement, list[Path]]"]


class TrialFailed(RunFailed):
    """A measured run did not finish, or finished without a throughput; its log tail is in the message."""


@dataclass
class OptimizationResult:
    """What the loop found: the best overrides, every decision, and where the best config went."""

    baseline: Measurement
    best: Measurement
    best_overrides: dict[str, Any]
    decisions: list[Decision]
    best_yaml: str
    stopped_because: str
    wall_s: float
    trials: int
    best_run_dirs: list[Path] = field(default_factory=list)
    recorded_run_id: str | None = None

    @property
    def kept(self) -> list[Decision]:
        return [d for d in self.decisions if d.kept]

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.baseline.tokens_per_s


# ---------------------------------------------------------------- measuring

def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def measure_config(config: Config, nproc: int, repeats: int) -> tuple[Measurement, list[Path]]:
    """Run ``config`` ``repeats`` times, one after another; throughput from each run, the rest averaged.

    Runs go one at a time on purpose: two runs sharing the cores would each measure the other.
    """
    summaries, run_dirs = [], []
    for i in range(repeats):
        label = f"measurement {i + 1}/{repeats}"
        try:
            run = run_to_end(config, nproc, label)
        except RunFailed as failed:
            raise TrialFailed(str(failed)) from None
        if not (run.summary or {}).get("tokens_per_s"):
            raise TrialFailed(f"run {label!r} measured no throughput: see {run.run_dir}/launcher.log")
        summaries.append(run.summary)
        run_dirs.append(run.run_dir)
    measurement = Measurement.from_repeats(
        [s["tokens_per_s"] for s in summaries], mfu=_mean([s.get("mfu") for s in summaries]),
        comm_frac=_mean([s.get("comm_frac") for s in summaries]),
        comm_exposed_frac=_mean([s.get("comm_exposed_frac") for s in summaries]),  # what classify decides on
        loss=_mean([s.get("final_loss") for s in summaries]))
    return measurement, run_dirs


# ---------------------------------------------------------------- what this labkit has

def _field_type(key: str) -> Any:
    """The annotation of a dotted config key (``"comm.compression"`` → its Literal), or None if unknown."""
    cls: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def config_allows(key: str, value: Any) -> bool | str:
    """True if labkit's config accepts ``key=value``; otherwise the reason, in words."""
    if key in LAUNCH_KEYS:
        return True
    tp = _field_type(key)
    if tp is None:
        return f"labkit's config has no key {key!r}"
    if typing.get_origin(tp) is typing.Literal and value not in typing.get_args(tp):
        return f"labkit has no {key}={value} (choices: {', '.join(map(str, typing.get_args(tp)))})"
    return True


def default_available() -> dict[str, bool | str]:
    """Every candidate the flowchart can propose → True, or why this labkit cannot try it."""
    out: dict[str, bool | str] = {}
    for node in NODES:
        for candidate in candidate_actions(node, {}):
            key, value = next(iter(candidate.overrides.items()))
            out[candidate.feature] = config_allows(key, value)
    return out


# ---------------------------------------------------------------- the loop

def check_inputs(thresholds: Thresholds, max_trials: int, time_budget_s: float, repeats: int) -> None:
    """Refuse a loop that cannot do anything, before a single run starts."""
    thresholds.validate()
    if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
        raise ValueError(f"max_trials={max_trials!r}: the budget must allow at least one trial (an int >= 1)")
    if not isinstance(time_budget_s, (int, float)) or not time_budget_s > 0:
        raise ValueError(f"time_budget_s={time_budget_s!r}: the time budget must be > 0 seconds")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: measure each config at least once (2+ gives the noise)")


class _Walk:
    """The loop's state: the current best, what was tried, the budgets. ``optimize`` drives it."""

    def __init__(self, config, nproc, thresholds, max_trials, time_budget_s, repeats, available, on_decision,
                 measure, allow_model_changes):
        self.config, self.nproc, self.t = config, nproc, thresholds
        self.max_trials, self.budget, self.repeats = max_trials, time_budget_s, repeats
        self.available, self.on_decision, self.measure = available, on_decision, measure
        self.allow_model_changes = allow_model_changes
        self.start = time.monotonic()
        self.decisions: list[Decision] = []
        self.kept: dict[str, Any] = {}
        self.tried: set[str] = set()
        self.trials = 0
        self.last_measure_s = 0.0
        self.best_run_dirs: list[Path] = []
        self.baseline = self.current = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def log(self, node, candidate, trial, kept, reason) -> None:
        decision = Decision(len(self.decisions), node, candidate, self.current, trial, kept, reason)
        self.decisions.append(decision)
        if self.on_decision:
            self.on_decision(decision)

    def trial_config(self, overrides: dict) -> tuple[Config, int]:
        config_keys = {k: v for k, v in overrides.items() if k not in LAUNCH_KEYS}
        return self.config.replace(**config_keys), overrides.get("nproc", self.nproc)

    def timed_measure(self, overrides: dict) -> tuple[Measurement, list[Path]]:
        began = time.monotonic()
        measurement, run_dirs = self.measure(*self.trial_config(overrides), self.repeats)
        self.last_measure_s = time.monotonic() - began
        measurement.overrides = dict(overrides)
        return measurement, run_dirs

    def out_of_budget(self) -> str | None:
        if self.trials >= self.max_trials:
            return f"trial budget spent ({self.trials} of {self.max_trials})"
        if self.elapsed() + self.last_measure_s > self.budget:
            return (f"time budget: {self.elapsed():.0f} s used, a trial takes ~{self.last_measure_s:.0f} s, "
                    f"budget {self.budget:g} s")
        return None

    def settings(self) -> dict[str, Any]:
        return {**flatten(self.config.to_dict()), "nproc": self.nproc, **self.kept}

    def next_candidate(self, node: str) -> Candidate | None:
        """Recomputed after every keep: a kept compressor changes what, say, local SGD must undo."""
        candidates = candidate_actions(node, self.settings(), self.available,
                                       max_nproc=max_procs(resolve_device(self.config)))
        return next((c for c in candidates if c.feature not in self.tried), None)

    def why_not_runnable(self, candidate: Candidate) -> str | None:
        if not candidate.available:
            return f"skipped, not available: {candidate.unavailable_reason}"
        if candidate.changes_model and not self.allow_model_changes:
            return "skipped: this changes the model, not just how it trains (pass allow_model_changes=True)"
        try:
            validate(*self.trial_config({**self.kept, **candidate.overrides}))
        except ConfigError as error:
            return "skipped, invalid config: " + "; ".join(error.problems)
        return None

    def try_candidate(self, node: str, candidate: Candidate) -> None:
        self.tried.add(candidate.feature)
        skip = self.why_not_runnable(candidate)
        if skip:
            self.log(node, candidate, None, False, skip)
            return
        self.trials += 1
        try:
            trial, run_dirs = self.timed_measure({**self.kept, **candidate.overrides})
        except TrialFailed as error:
            self.log(node, candidate, None, False, f"rejected: the trial run failed ({str(error).splitlines()[0]})")
            return
        kept, reason = accept(self.current, trial, self.t)
        self.log(node, candidate, trial, kept, reason)
        if kept:
            self.kept.update(candidate.overrides)
            self.current, self.best_run_dirs = trial, run_dirs

    def walk(self) -> str:
        self.baseline, self.best_run_dirs = self.timed_measure({})
        self.current = self.baseline
        node, why = classify(self.baseline, self.t)
        self.log(MEASURE, None, None, False, f"baseline {self.baseline.tokens_per_s:,.0f} tokens/s → {node}: {why}")
        while node is not None:
            candidate = self.next_candidate(node)
            while candidate is not None:
                stop = self.out_of_budget() if candidate.available else None
                if stop:
                    return stop
                self.try_candidate(node, candidate)
                candidate = self.next_candidate(node)
            node = next_node(node)
        return "every node's candidates tried"


def optimize(config: Config, nproc: int = 2, thresholds: Thresholds | None = None, max_trials: int = 6,
             time_budget_s: float = 600.0, repeats: int = 2, steps: int | None = None,
             available: dict[str, bool | str] | None = None, on_decision: Callable[[Decision], None] | None = None,
             store=None, out_yaml: str | Path | None = None, *, allow_model_changes: bool = False,
             measure: Measurer | None = None) -> OptimizationResult:
    """Walk the optimisation flowchart with real runs of ``config`` on ``nproc`` processes.

    ``max_trials`` counts measured trials (skipped candidates are free); ``time_budget_s`` stops the
    walk before a trial that would not fit. ``steps`` overrides ``run.steps`` for every measured run.
    ``available``: feature → True / reason, as in :func:`labkit.tuning.flowchart.candidate_actions`; merged over
    :func:`default_available`. ``store``: a :class:`~labkit.metrics.store.RunStore` to record the best
    run in. ``measure(config, nproc, repeats) -> (Measurement, run_dirs)`` replaces the real runs
    (tests, replays). Raises ``ValueError`` for an empty budget or bad thresholds before any run.
    """
    thresholds = thresholds or Thresholds()
    check_inputs(thresholds, max_trials, time_budget_s, repeats)
    if steps is not None:
        config = config.replace(**{"run.steps": steps})
    validate(config, nproc)
    walk = _Walk(config, nproc, thresholds, max_trials, time_budget_s, repeats,
                 {**default_available(), **(available or {})}, on_decision, measure or measure_config,
                 allow_model_changes)
    stopped = walk.walk()
    text = best_config_yaml(config.to_dict(), walk.kept)
    walk.log(RECORD_BEST, None, None, False, f"stopped: {stopped}; best config keeps "
             + (", ".join(f"{k}={v}" for k, v in walk.kept.items()) or "nothing (the baseline was best)"))
    if out_yaml is not None:
        Path(out_yaml).write_text(text)
    recorded = store.record_run(walk.best_run_dirs[-1]) if store is not None and walk.best_run_dirs else None
    return OptimizationResult(walk.baseline, walk.current, dict(walk.kept), walk.decisions, text, stopped,
                              walk.elapsed(), walk.trials, walk.best_run_dirs, recorded)
