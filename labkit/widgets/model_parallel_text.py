"""The model-parallel lab's printed tables (``labkit.widgets.model_parallel`` runs the layouts and holds the panel).

Each reads the rows :mod:`labkit.parallel.reports.layout` computes from a run's events: tensor parallelism's bytes
beside the analytic count, model states per rank beside the prediction, the step split into its parts, the bubble
beside the formula, the micro-batches a pipeline held, the activations per rank. Narrow enough to print without
wrapping (``labkit.text.PRINT_WIDTH``).
"""
from __future__ import annotations

from typing import Optional

from labkit.parallel.reports.activation_memory import format_activation_memory
from labkit.parallel.reports.layout import SPLIT_PARTS
from labkit.text import wrap


def in_flight_text(summaries: list[tuple[str, dict]]) -> str:
    """Per pipeline run: the most micro-batches stage 0 held at once, measured and predicted, and what their
    activations came to (one micro-batch's saved tensors, counted by the run, times that many)."""
    lines = []
    for label, s in summaries:
        held = "an uncounted number of" if s["in_flight"] is None else s["in_flight"]
        line = (f"{label:18s}: stage 0 held {held} micro-batches' activations at once "
                f"(predicted {s['in_flight_predicted']})")
        if s.get("activation_bytes") and s.get("in_flight"):
            line += f", {s['in_flight'] * s['activation_bytes'] / 1e6:.2f} MB"
        lines.append(line)
    return "\n".join(lines)


def activation_text(reports: list[tuple[str, dict]]) -> str:
    """``model_parallel.activation_rows`` as one plain-text table per run."""
    return wrap("\n\n".join(f"{label}: activations per rank (MB per micro-batch; held: measured (schedule's))\n"
                            f"{format_activation_memory(report)}" for label, report in reports))


def _percent(share: Optional[float]) -> str:
    return "  n/a" if share is None else f"{100 * share:5.1f}%"


def bubble_text(rows: list[dict]) -> str:
    """Per pipeline run: the measured bubble, the stages' idle share and the formula (n/a where a run's schedule
    was not timed span by span: torch's)."""
    return "\n".join(f"p={r['p']} m={r['m']:2d} {r['schedule']:6s}: bubble measured {_percent(r['bubble'])} "
                     f"(stages idle {_percent(r['idle'])}), formula {_percent(r['ideal'])}" for r in rows)


def tp_bytes_text(rows: list[tuple[str, dict]]) -> str:
    """Tensor parallelism's bytes per run, measured beside the analytic count: a table narrow enough to print."""
    lines = [f"{'':14s} {'MB per step':>21s}   {'MB per layer per micro-batch':>28s}",
             f"{'run':14s} {'measured':>10s} {'analytic':>10s}   {'measured':>13s} {'analytic':>14s}"]
    uncounted = False
    for label, r in rows:
        if r["measured_total"] is None:
            uncounted = True
            measured, per_layer = "n/a *", "n/a *"
        else:
            measured, per_layer = f"{r['measured_total'] / 1e6:.3f}", f"{r['measured_per_layer'] / 1e6:.4f}"
        lines.append(f"{label:14s} {measured:>10s} {r['analytic_total'] / 1e6:>10.3f}   {per_layer:>13s} "
                     f"{r['analytic_per_layer'] / 1e6:>14.4f}")
    if uncounted:
        lines.append("* not counted: torch's DTensor collectives")
    return "\n".join(lines)


def memory_text(runs: list[tuple[str, list[dict]]]) -> str:
    """Model-state memory per rank, measured beside the layout's prediction: a narrow table."""
    lines = [f"{'run':18s} {'rank':>4s} {'dp pp tp':>8s} {'parameters':>11s} "
             f"{'measured MB':>12s} {'predicted MB':>13s}"]
    lines += [f"{label:18s} {r['rank']:>4d} {r['dp']:>2d} {r['pp']:>2d} {r['tp']:>2d} {r['params']:>11,.0f} "
              f"{r['measured_total'] / 1e6:>12.3f} {r['predicted_total'] / 1e6:>13.3f}"
              for label, rows in runs for r in rows]
    return "\n".join(lines)


def split_text(splits: list[tuple[str, dict]]) -> str:
    """Each run's mean step split into its parts (ms): a narrow table, with a note under it for the parts a run did
    not time."""
    names = {"compute": "compute", "data": "data", "dp_comm": "dp comm", "model_comm": "tp comm",
             "bubble": "bubble"}
    lines = [f"{'ms per step':24s} {'step':>7s} " + " ".join(f"{names[p]:>8s}" for p in SPLIT_PARTS)]
    notes = []
    for label, s in splits:
        if s["compute"] is None:
            lines.append(f"{label:24s} {1e3 * s['step']:7.1f}  split n/a for this strategy")
            continue
        untimed = [what for what, key in (("torch's tensor-parallel collectives", "model_comm_counted"),
                                          ("torch's pipeline waits", "bubble_counted")) if not s.get(key, True)]
        mark = ""
        if untimed:
            notes.append(f"{label}: {' and '.join(untimed)} not timed, inside compute")
            mark = f" {'*' * len(notes)}"
        lines.append(f"{label:24s} {1e3 * s['step']:7.1f} " + " ".join(f"{1e3 * s[p]:8.1f}" for p in SPLIT_PARTS)
                     + mark)
    lines += [f"{'*' * (i + 1)} {note}" for i, note in enumerate(notes)]
    return wrap("\n".join(lines), indent="  ")
