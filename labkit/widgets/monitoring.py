"""Monitoring pictures beyond the main dashboard: per-rank lanes, memory efficiency, alerts, trends.

* :func:`ranks_figure` — layer 1, per rank: each rank's time outside communication, side by side
  (in lock-step training every rank's *step* time is the same, so a straggler shows here, not
  there), its time in communication — in flight (waiting included) and, dashed, exposed (what backward
  did not hide) — and the run's alerts (layer 3) marked where they fired.
* :func:`memory_figure` — memory efficiency: the peak against what the device offers, and the
  peak split into parameters, gradients, optimizer state and saved activations where measured.
* :func:`trend_figure` — layer 2: throughput of one configuration across runs over time, with the
  runs the store flags as regressions circled.
* :func:`diagnosis_html` — what an alert's profiles found: each profiled rank's top operators, in a table
  narrow enough for a notebook's width (:func:`profile_table_html`).

Every figure is drawn at a notebook's output width (``labkit.plots.OUTPUT_WIDTH_PX``), no text under 12 px there.
"""
from __future__ import annotations

import html
import re
import textwrap
import time
from pathlib import Path
from typing import Optional

from matplotlib.figure import Figure

from labkit.metrics.events import final_trajectory
from labkit.plots import OUTPUT_WIDTH_PX, label_axes

WIDTH = OUTPUT_WIDTH_PX / 100  # inches at 100 dpi: shown 1:1 in a notebook's output area, text legible
SMALL_FONT = 11  # points: 15 px as shown, the smallest text these figures draw
ALERT_GAP = 0.045
"""Alerts nearer than this share of the step axis are labelled together (a 15 px label's width on a ~420 px axes)."""


def _steps(events: list[dict]) -> list[dict]:
    return [e for e in final_trajectory(events) if e.get("rank_busy_s")]


def alert_label(alert: dict) -> str:
    return alert["kind"] + ("" if alert.get("rank") is None else f" (rank {alert['rank']})")


def alert_groups(alerts: list[dict], min_gap: float) -> list[tuple[float, str]]:
    """Alerts closer than ``min_gap`` steps to the first of their group share one label (their kinds, each once,
    with a count when repeated), placed at that first alert's step: labels of alerts a step or two apart would
    be drawn over each other."""
    groups: list[tuple[float, list[str]]] = []
    for alert in sorted(alerts, key=lambda a: a["step"]):
        if groups and alert["step"] - groups[-1][0] < min_gap:
            groups[-1][1].append(alert_label(alert))
        else:
            groups.append((alert["step"], [alert_label(alert)]))
    return [(step, ", ".join(f"{k} ×{labels.count(k)}" if labels.count(k) > 1 else k for k in dict.fromkeys(labels)))
            for step, labels in groups]


def ranks_figure(events: list[dict]) -> Figure:
    steps = _steps(events)
    alerts = [e for e in events if e.get("type") == "alert"]
    fig = Figure(figsize=(WIDTH, 4.6), dpi=100, layout="constrained")
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
    for alert in alerts:
        for ax in (ax_busy, ax_comm):
            ax.axvline(alert["step"], color="#C44E52", ls=":", lw=1.5)
    span = max([*x, *(a["step"] for a in alerts)], default=1) - min([*x, *(a["step"] for a in alerts)], default=0)
    for step, label in alert_groups(alerts, min_gap=max(1.0, ALERT_GAP * span)):
        ax_busy.annotate(textwrap.shorten(label, 34, placeholder="…"), (step, 0.98), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=SMALL_FONT, color="#C44E52",
                         bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})
    label_axes(ax_busy, "Per rank: time outside comm.", "step", "ms", legend=False)
    label_axes(ax_comm, "In flight (waits too); dashed: exposed", "step", "ms", legend=False)
    if world:  # one legend for both panels, below them: none over the curves or the alerts' labels
        fig.legend(*ax_comm.get_legend_handles_labels(), loc="outside lower center", ncol=min(2 * world, 4),
                   fontsize=SMALL_FONT)
    return fig


def memory_figure(events: list[dict]) -> Figure:
    """Peak memory per step against capacity, and the last step's split by kind."""
    steps = final_trajectory(events)
    start = next((e for e in events if e.get("type") == "start"), {})
    capacity = start.get("memory_capacity_bytes")
    fig = Figure(figsize=(WIDTH, 4.2), dpi=100, layout="constrained")
    ax_peak, ax_split = fig.subplots(1, 2)
    ax_peak.plot([e["step"] for e in steps], [e["max_mem_bytes"] / 2**20 for e in steps], lw=2, label="peak")
    if capacity:
        ax_peak.axhline(capacity / 2**20, color="gray", ls="--", label="capacity per rank")
        if steps:
            used = steps[-1]["max_mem_bytes"] / capacity
            ax_peak.set_title(f"Peak memory: {used:.1%} of capacity", fontsize=13)
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
        ax_split.bar_label(bars, fmt="%.2f", fontsize=SMALL_FONT, padding=3)
        other = max(0.0, last["max_mem_bytes"] / 2**20 - sum(v for _, v in measured))
        rest = ax_split.barh(["everything else\n(runtime, buffers)"], [other], color="#BBBBBB")
        ax_split.bar_label(rest, fmt="%.0f", fontsize=SMALL_FONT, label_type="center")
    label_axes(ax_split, "Where the peak goes (last step, rank 0)", "MiB", "", legend=False)
    return fig


def trend_figure(trend: list[dict], regressions: Optional[list[dict]] = None, title: str = "") -> Figure:
    """Tokens/s of the runs ``RunStore.trend`` returned, oldest first; flagged regressions circled."""
    fig = Figure(figsize=(WIDTH, 4.4), dpi=100, layout="constrained")
    ax = fig.subplots()
    runs = [r for r in trend if r.get("tokens_per_s") is not None]
    ax.plot(range(len(runs)), [r["tokens_per_s"] for r in runs], "o-", lw=2, label="tokens/s")
    flagged = {r["id"] for r in regressions or []}
    hits = [(i, r["tokens_per_s"]) for i, r in enumerate(runs) if r["id"] in flagged]
    if hits:
        ax.plot(*zip(*hits), "o", ms=18, mfc="none", mec="#C44E52", mew=2.5, label="regression")
    ax.set_xticks(range(len(runs)), [time.strftime("%m-%d %H:%M", time.localtime(r["created"])) for r in runs],
                  rotation=30, fontsize=SMALL_FONT)
    label_axes(ax, title or "Throughput of the same configuration across runs", "run (when it started)",
               "tokens/s")
    return fig


# ---------------------------------------------------------------- a profiler capture's top operators, readable

PROFILE_COLUMNS = ("operator", "self time", "share", "calls")
NAME_CHARS = 30  # an operator's name is cut past this many characters (two tables fit side by side in ~968 px)


def profile_rows(table: str, limit: int = 10) -> list[dict]:
    """The top operators of ``torch.profiler``'s formatted table (what a diagnosis' ``.txt`` holds), four numbers
    kept of torch's seven or more: name, self time and its share (device time where the capture has it, else
    CPU), and the call count. Columns are cut where torch's own dashed rule puts them, so a name with spaces
    stays whole."""
    lines = table.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    if len(rules) < 3:
        return []
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[rules[0]])]
    header = [lines[rules[0] + 1][a:b].strip() for a, b in spans]
    kind = next((k for k in ("Device", "CUDA") if f"Self {k}" in header), "CPU")
    wanted = {"operator": "Name", "self time": f"Self {kind}", "share": f"Self {kind} %", "calls": "# of Calls"}
    where = {col: header.index(name) for col, name in wanted.items() if name in header}
    rows = []
    for line in lines[rules[1] + 1:rules[2]][:limit]:
        cells = [line[a:b].strip() for a, b in spans]
        rows.append({col: cells[i] for col, i in where.items()})
    return rows


def profile_table_html(text: str, title: str = "", limit: int = 10) -> str:
    """A diagnosis' ``.txt`` (its summary line, then torch's table) as a compact HTML table that fits a notebook's
    width: four columns, no cell wrapped, a long operator name shortened (the full name on hover)."""
    summary = text.split("; trace:", 1)[0].splitlines()[0] if text.strip() else ""
    cell = "padding:2px 8px;white-space:nowrap;text-align:{}"
    head = "".join(f"<th style='{cell.format('left' if c == 'operator' else 'right')}'>{c}</th>"
                   for c in PROFILE_COLUMNS)
    body = ""
    for row in profile_rows(text, limit):
        name = row.get("operator", "")
        short = name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 1] + "…"
        body += (f"<tr><td style='{cell.format('left')}' title='{html.escape(name, quote=True)}'>"
                 f"<code>{html.escape(short)}</code></td>"
                 + "".join(f"<td style='{cell.format('right')}'>{html.escape(row.get(c, ''))}</td>"
                           for c in PROFILE_COLUMNS[1:]) + "</tr>")
    caption = f"<div style='font-weight:600'>{html.escape(title)}</div>" if title else ""
    return (f"<div style='display:inline-block;vertical-align:top;margin:0 24px 12px 0;max-width:100%;"
            f"overflow-x:auto'>{caption}<div style='color:#555'>{html.escape(summary)}</div>"
            f"<table style='border-collapse:collapse;table-layout:auto;margin:0;font-size:0.9em'>"
            f"<tr>{head}</tr>{body}</table></div>")


def diagnosis_html(alert: dict) -> str:
    """The top-operator tables of the profiles an alert started, side by side where they fit: the rank it named
    and a healthy one (the difference between the two is the diagnosis)."""
    parts = []
    for trace in alert.get("traces") or []:
        rank = int(re.search(r"rank(\d+)", Path(trace).name).group(1))
        who = "the rank the alert named" if rank == alert.get("rank") else "a healthy rank, for comparison"
        text = Path(trace).with_suffix(".txt")
        parts.append(profile_table_html(text.read_text(), f"rank {rank}: {who}") if text.exists()
                     else f"<div>rank {rank}: no profile was written ({html.escape(text.name)} missing)</div>")
    return "<div>" + "".join(parts) + "</div>"
