"""Layer 3 in the training loop: anomalies become alerts, alerts start a diagnosis — never a change.

Every rank runs the same :class:`~labkit.metrics.anomaly.AnomalyMonitor` on the same step event
(its per-rank lists are gathered, so all ranks agree on who straggles). When a detector fires, rank
0 writes an ``alert`` event, and the ranks named by the diagnosis request profile the next
``metrics.profile_steps`` steps with ``torch.profiler``: each writes a Chrome trace
(``RUN_DIR/diagnosis/alertN-rankR.json``, open it in Perfetto or chrome://tracing) and a text
summary beside it — the top operators and the compute/communication split.

Training parameters are never touched: what to change is a person's (or ``labkit.tuning``'s) call.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from labkit.metrics.anomaly import AnomalyMonitor, diagnosis_request
from labkit.metrics.profile import summarize_profile


def shared_view(event: dict) -> dict:
    """The step as every rank sees it alike: rank-local timings replaced by their gathered versions.

    Each rank must reach the same verdicts — the trace numbering and who profiles depend on it — so
    the monitor judges only numbers that are identical everywhere: the slowest rank's step time and
    the all-rank communication shares, in flight and exposed (loss, tokens/s and peak memory already are
    all-rank numbers). Exposed is None when a rank did not measure it (``fsdp2``) or the event predates
    ``rank_comm_exposed_s``: a rank-local number would let the ranks disagree.
    """
    times, comms = event.get("rank_step_time_s"), event.get("rank_comm_s")
    if not times or not comms:
        return event
    total = sum(times)
    exposed = event.get("rank_comm_exposed_s")
    measured = bool(exposed) and len(exposed) == len(times) and all(e is not None for e in exposed)
    return {**event, "step_time_s": max(times), "comm_frac": sum(comms) / total if total else None,
            "comm_exposed_frac": sum(exposed) / total if measured and total else None}


# When one step raises several alerts, the most specific diagnosis gets the capture.
SPECIFICITY = {"straggler": 0, "memory_growth": 1, "comm_frac_jump": 2, "step_time_spike": 3, "throughput_drop": 4}


class Watchdog:
    def __init__(self, metrics_cfg, env, run_dir: str | Path, sink=None):
        self.monitor = AnomalyMonitor(metrics_cfg.anomaly)
        self.profile_steps, self.max_diagnoses = metrics_cfg.profile_steps, metrics_cfg.max_diagnoses
        self.env, self.sink = env, sink
        self.directory = Path(run_dir) / "diagnosis"
        self.alerts: list[dict] = []
        self.diagnoses = 0
        self.profiler: Optional[torch.profiler.profile] = None
        self.remaining = 0
        self.trace_path: Optional[Path] = None
        self.capturing = 0  # steps left in the capture in progress (the same on every rank)
        self.captured_ranks: list[int] = []  # who the capture in progress covers

    def observe(self, event: dict) -> None:
        """Judge a finished step; on an alert, record it and arm a profile of the next steps."""
        alerts = self.monitor.observe(shared_view(event))
        for alert in sorted(alerts, key=lambda a: SPECIFICITY.get(a.kind, len(SPECIFICITY))):
            request = diagnosis_request(alert, self.env.world_size, self.profile_steps)
            record = {"kind": alert.kind, "step": alert.step, "rank": alert.rank, "value": alert.value,
                      "baseline": alert.baseline, "threshold": alert.threshold, "message": alert.message}
            traces = self._arm(request) if request["profile"] else []
            self.alerts.append(record)
            if self.sink:
                self.sink.write("alert", **record, diagnosis=request["why"], traces=[str(t) for t in traces])

    def _arm(self, request: dict) -> list[Path]:
        """Start profiling from the next step on the requested ranks (one capture at a time);
        returns the trace files the capture will write (empty when none is started). An alert
        raised while a capture covering its ranks is in progress shares that capture's traces."""
        ranks = list(range(self.env.world_size)) if request["ranks"] == "all" else list(request["ranks"])
        if self.capturing > 0:
            shared = all(r in self.captured_ranks for r in ranks)
            return [self.directory / f"alert{self.diagnoses}-rank{r}.json" for r in ranks] if shared else []
        if self.profile_steps <= 0 or self.diagnoses >= self.max_diagnoses:
            return []
        self.diagnoses += 1
        self.capturing = self.profile_steps  # counted on every rank, profiling or not: they stay in step
        self.captured_ranks = ranks
        traces = [self.directory / f"alert{self.diagnoses}-rank{r}.json" for r in ranks]
        if self.env.rank not in ranks:
            return traces
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=request["record_shapes"],
                                               profile_memory=request["profile_memory"])
        self.profiler.__enter__()
        self.remaining = self.profile_steps
        self.trace_path = self.directory / f"alert{self.diagnoses}-rank{self.env.rank}.json"
        return traces

    def after_step(self) -> None:
        """Count a profiled step; after the last one, write the trace and its summary."""
        self.capturing = max(0, self.capturing - 1)
        if self.profiler is None:
            return
        self.remaining -= 1
        if self.remaining > 0:
            return
        self.profiler.__exit__(None, None, None)
        summary = summarize_profile(self.profiler, self.trace_path)
        self.trace_path.with_suffix(".txt").write_text(summary.describe() + "\n\n" + summary.table + "\n")
        self.profiler = None

    def close(self) -> None:
        if self.profiler is not None:  # the run ended mid-capture: keep what was recorded
            self.remaining = 1
            self.after_step()
