"""Notebook 07's chaos section: a soak of many faults, read from ``benchmarks/chaos_soak.py``'s shipped results.

The soak (:mod:`labkit.soak`) takes minutes — a reference run, a restart probe, then one run that lives
through dozens of faults — so the lab shows the newest full soak recorded in ``benchmarks/results/chaos_soak.jsonl``
(its machine and commit said), and says how to run one: :func:`soak_text` and :func:`soak_figure`.
"""
from __future__ import annotations

from typing import Optional

from matplotlib.figure import Figure

from labkit.plots import OUTPUT_WIDTH_PX, label_axes

NAME = "chaos_soak"
KIND_COLOURS = {"crash": "#C44E52", "kill": "#8C2D04", "hang": "#8172B3", "corrupt_checkpoint": "#DD8452",
                "nan": "#4C72B0", "straggler": "#55A868"}
LOST_TERMS = (("saves", "checkpoint saves"), ("restarts", "restarts"), ("timeouts", "hang timeouts"),
              ("replayed", "work done again"), ("stragglers", "straggler delay"))


def shipped_soak(quick: bool = False) -> Optional[tuple[dict, list[dict]]]:
    """The newest soak in the shipped results: (its summary record, its faults record), or None if there is none."""
    from labkit.results import latest, load_results, results_path

    if not results_path(NAME).exists():
        return None
    records = load_results(NAME)
    try:
        summary = latest(records, "chaos_soak", quick=quick)
    except LookupError:
        return None
    faults = next((r for r in reversed(records) if r["table"] == "chaos_soak_faults"
                   and r["commit"] == summary["commit"] and r["settings"] == summary["settings"]), None)
    return summary, faults["rows"] if faults else []


def soak_text(summary: dict) -> str:
    """What the soak did and whether the prediction held, in the record's own numbers."""
    row = summary["rows"][0]
    verdict = "held" if row["points_apart"] <= row["target_points"] else "MISSED"
    machine = summary["machine"]
    return "\n".join([
        f"recorded {summary['date'][:10]} at {summary['commit'][:7]} on {machine['cpu']} ({machine['cores']} cores), "
        f"{summary['settings']['nproc']} processes",
        f"{row['faults']} faults ({', '.join(row['kinds'])}), {row['restarts']} of them restarts, in "
        f"{row['soak_s']:.0f} s (bound {row['bound_s']:.0f} s)",
        f"useful fraction: predicted {row['predicted_useful_fraction']:.1%} before the soak, measured "
        f"{row['measured_useful_fraction']:.1%}: {row['points_apart']:.1f} points apart (target ≤ "
        f"{row['target_points']:g}) — {verdict}",
        f"wall time from the first step to the last: predicted {row['predicted_wall_s']:.0f} s, measured "
        f"{row['measured_wall_s']:.0f} s",
        f"final model against a clean run with the same dropped updates {row['dropped_updates']}: {row['equality']}"])


def soak_figure(summary: dict, faults: list[dict]) -> Figure:
    """Left: every fault at its step, the seconds to detect it and to recover (0 for the kinds that end no attempt).
    Right: the wall time, predicted term by term beside the measured — useful steps, and what the faults cost."""
    row = summary["rows"][0]
    fig = Figure(figsize=(OUTPUT_WIDTH_PX / 100, 4.6), dpi=100, layout="constrained")
    ax_faults, ax_wall = fig.subplots(1, 2, width_ratios=(3, 2))
    for kind, colour in KIND_COLOURS.items():
        mine = [f for f in faults if f["kind"] == kind]
        if mine:
            ax_faults.scatter([f["step"] for f in mine], [f["recovery_s"] or 0 for f in mine], s=70, color=colour,
                              label=kind.replace("_", " "), zorder=3)
    seen = [f for f in faults if f.get("detected_s") is not None]
    ax_faults.scatter([f["step"] for f in seen], [f["detected_s"] for f in seen], s=25, marker="x", color="black",
                      label="detected", zorder=4)
    label_axes(ax_faults, "Each fault: detected, then recovered", "step it struck", "seconds after it")
    useful = row["measured_useful_fraction"] * row["measured_wall_s"]
    left, terms = row["predicted_useful_fraction"] * row["predicted_wall_s"], row["predicted_terms_s"]
    ax_wall.barh(1, left, color="#4C72B0", label="useful steps")
    ax_wall.barh(0, useful, color="#4C72B0")
    for i, (key, name) in enumerate(LOST_TERMS):
        ax_wall.barh(1, terms[key], left=left, color=f"C{i + 1}", label=name)
        left += terms[key]
    ax_wall.barh(0, row["measured_wall_s"] - useful, left=useful, color="#BBBBBB", label="all the rest (measured)")
    ax_wall.set_yticks([0, 1], ["measured", "predicted"])
    label_axes(ax_wall, f"Wall time: useful {row['predicted_useful_fraction']:.0%} predicted, "
                        f"{row['measured_useful_fraction']:.0%} measured", "seconds", "", legend=False)
    ax_wall.legend(fontsize=9, loc="lower right")
    return fig
