"""Monitoring pictures beyond the main dashboard: per-rank lanes, memory efficiency, alerts, trends.

* :func:`ranks_figure` — layer 1, per rank: each rank's time outside communication, side by side
  (in lock-step training every rank's *step* time is the same, so a straggler shows here, not
  there), its time in communication — in flight (waiting included) and, dashed, exposed (what backward
  did not hide) — and the run's alerts (layer 3) marked where they fired.
* :func:`memory_figure` — memory efficiency: the peak against what the device offers, and the
  peak split into parameters, gradients, optimizer state and saved activations where measured.
* :func:`trend_figure` — layer 2: throughput of one configuration across runs over time, with the
  runs the store flags as regressions circled.
"""
from __future__ import annotations

import time
from typing import Optional

from matplotlib.figure import Figure

from labkit.metrics.events import final_trajectory
from labkit.plots import label_axes


def _steps(events: list[dict]) -> list[dict]:
    return [e for e in final_trajectory(events) if e.get("rank_busy_s")]


def ranks_figure(events: list[dict]) -> Figure:
    steps = _steps(events)
    alerts = [e for e in events if e.get("type") == "alert"]
    fig = Figure(figsize=(13, 4.6), dpi=100, layout="constrained")
    ax_busy, ax_comm = fig.subplots(1, 2, sharex=True)
    x = [e["step"] for e in steps]
    world = max((len(e["rank_busy_s"]) for e in steps), default=0)
    for r in range(world):
        ax_busy.plot(x, [1e3 * e["rank_busy_s"][r] for e in steps], lw=1.5, label=f"rank {r}")
        line, = ax_comm.plot(x, [1e3 * e["rank_comm_s"][r] for e in steps], lw=1.5, label=f"rank {r}")
        exposed = [(e["step"], 1e3 * e["rank_comm_exposed_s"][r]) for e in steps
                   if r < len(e.get("rank_comm_exposed_s") or []) and e["rank_comm_exposed_s"][r] is not None]
        if exposed:
            ax_comm.plot(*zip(*exposed), lw=1.5, ls="--", color=line.get_color(), label=f"rank {r} exposed")
    for i, alert in enumerate(alerts):
        for ax in (ax_busy, ax_comm):
            ax.axvline(alert["step"], color="#C44E52", ls=":", lw=1.5)
        ax_busy.annotate(alert["kind"] + ("" if alert.get("rank") is None else f" (rank {alert['rank']})"),
                         (alert["step"], 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                         ha="right", fontsize=10, color="#C44E52")
    label_axes(ax_busy, "Per rank: time outside communication", "step", "ms", legend=bool(world))
    label_axes(ax_comm, "Per rank: comm in flight (waits too); dashed: exposed", "step", "ms", legend=bool(world))
    return fig


def memory_figure(events: list[dict]) -> Figure:
    """Peak memory per step against capacity, and the last step's split by kind."""
    steps = final_trajectory(events)
    start = next((e for e in events if e.get("type") == "start"), {})
    capacity = start.get("memory_capacity_bytes")
    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    ax_peak, ax_split = fig.subplots(1, 2)
    ax_peak.plot([e["step"] for e in steps], [e["max_mem_bytes"] / 2**20 for e in steps], lw=2, label="peak")
    if capacity:
        ax_peak.axhline(capacity / 2**20, color="gray", ls="--", label="capacity per rank")
        if steps:
            used = steps[-1]["max_mem_bytes"] / capacity
            ax_peak.set_title(f"Peak memory: {used:.1%} of capacity", fontsize=14)
    kind = "GPU allocated" if start.get("memory_kind") == "cuda_max_allocated" else "process RSS (CPU)"
    label_axes(ax_peak, ax_peak.get_title() or "Peak memory", "step", f"MiB ({kind})")
    if steps:
        last = steps[-1]
        parts = [(name, last.get(key)) for name, key in (("parameters", "param_bytes"), ("gradients", "grad_bytes"),
                                                         ("optimizer", "optimizer_bytes"),
                                                         ("activations", "activation_bytes"))]
        measured = [(n, v / 2**20) for n, v in parts if v is not None]
        colors = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"][:len(measured)]
        bars = ax_split.barh([n for n, _ in measured], [v for _, v in measured], color=colors)
        ax_split.bar_label(bars, fmt="%.2f MiB", fontsize=10, padding=3)
        other = max(0.0, last["max_mem_bytes"] / 2**20 - sum(v for _, v in measured))
        rest = ax_split.barh(["everything else\n(runtime, buffers)"], [other], color="#BBBBBB")
        ax_split.bar_label(rest, fmt="%.0f MiB", fontsize=10, label_type="center")
    label_axes(ax_split, "Where the peak goes (last step, this rank)", "MiB", "", legend=False)
    return fig


def trend_figure(trend: list[dict], regressions: Optional[list[dict]] = None, title: str = "") -> Figure:
    """Tokens/s of the runs ``RunStore.trend`` returned, oldest first; flagged regressions circled."""
    fig = Figure(figsize=(10, 4.4), dpi=100, layout="constrained")
    ax = fig.subplots()
    runs = [r for r in trend if r.get("tokens_per_s") is not None]
    ax.plot(range(len(runs)), [r["tokens_per_s"] for r in runs], "o-", lw=2, label="tokens/s")
    flagged = {r["id"] for r in regressions or []}
    hits = [(i, r["tokens_per_s"]) for i, r in enumerate(runs) if r["id"] in flagged]
    if hits:
        ax.plot(*zip(*hits), "o", ms=18, mfc="none", mec="#C44E52", mew=2.5, label="regression")
    ax.set_xticks(range(len(runs)), [time.strftime("%m-%d %H:%M", time.localtime(r["created"])) for r in runs],
                  rotation=30, fontsize=10)
    label_axes(ax, title or "Throughput of the same configuration across runs", "run (when it started)",
               "tokens/s")
    return fig
