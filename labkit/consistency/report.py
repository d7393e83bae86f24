"""Plain words for a consistency run: which of C and A it gave up during the partition, with its numbers."""
from __future__ import annotations

from typing import Optional

AGREED = 1e-9  # divergence at or below this is agreement (sync measures exactly 0)


def _others(summary: dict) -> list[dict]:
    """Availability records of the workers that were *not* cut off."""
    isolated = summary.get("partition_rank")
    return [a for rank, a in summary.get("availability", {}).items() if int(rank) != isolated]


def others_busy_in_partition(summary: dict) -> Optional[float]:
    """Share of the partition the workers that were not cut off spent computing (their mean)."""
    others = _others(summary)
    if not summary.get("partition") or not others:
        return None
    return sum(a["busy_in_partition"] for a in others) / len(others)


def availability_kept(summary: dict) -> Optional[str]:
    """'kept', 'partly' or 'gave up' — judged on the workers that could still reach each other."""
    others = _others(summary)
    inside = others_busy_in_partition(summary)
    if inside is None:
        return None
    outside = sum(a.get("busy_outside_partition") or 0.0 for a in others) / len(others)
    if inside < 0.05 * max(outside, 1e-9) or inside < 0.01:
        return "gave up"
    return "kept" if inside >= 0.5 * outside else "partly"


def consistency_kept(summary: dict) -> Optional[str]:
    if not summary.get("partition"):
        return None
    worst = summary.get("divergence_max_in_partition")
    if worst is None or worst <= AGREED:
        return "kept"
    return "bounded" if summary.get("consistency") == "ssp" else "gave up"


def verdict(summary: dict) -> str:
    """One paragraph: what happened to A and to C during the partition, in measured numbers."""
    mode = summary.get("consistency", "?")
    if summary.get("status") != "finished":
        return f"{mode}: the run did not finish ({summary.get('error', summary.get('status'))})."
    if not summary.get("partition"):
        return (f"{mode}: no partition — computing {summary['busy_fraction']:.0%} of the time, "
                f"max divergence {summary['divergence_max']:.3g}, final loss {summary['final_loss']:.3f}.")
    start, heal = summary["partition"]
    steps = sum(summary["steps_in_partition"][r] for r in summary["steps_in_partition"]
                if int(r) != summary.get("partition_rank"))
    busy = others_busy_in_partition(summary) or 0.0
    a_word, c_word = availability_kept(summary), consistency_kept(summary)
    text = [f"<b>{mode}</b> — partition of rank {summary['partition_rank']} for {heal - start:g} s:"]
    text.append({"gave up": "gave up <b>A</b>",
                 "partly": "kept <b>A</b> only in part",
                 "kept": "kept <b>A</b>"}[a_word] +
                f" (the other workers finished {steps} step(s) and computed {busy:.0%} of the time while it lasted)")
    worst = summary.get("divergence_max_in_partition")
    if c_word == "kept":
        text.append("kept <b>C</b> (replicas identical: divergence 0)" if summary["divergence_max"] <= AGREED
                    else "kept <b>C</b> while the partition lasted (no replica moved)")
    else:
        stale = summary.get("staleness_max")
        bound = f", staleness ≤ s = {summary['staleness_bound']} (max {stale})" if c_word == "bounded" else \
            (f", updates up to {stale} clocks stale" if stale is not None else "")
        text.append(("bounded <b>C</b>" if c_word == "bounded" else "gave up <b>C</b>") +
                    f" (replicas {worst:.3g} apart at most{bound})")
    recovery = summary.get("recovery_s")
    text.append("recovered " + (f"{recovery:.2f} s after the heal" if recovery is not None else "— not within the run"))
    return f"{text[0]} " + "; ".join(text[1:]) + f"; final loss {summary['final_loss']:.3f}."


def comparison_rows(summaries: list[dict]) -> list[dict]:
    """One row per run for the side-by-side table and the trade-off chart."""
    rows = []
    for s in summaries:
        rows.append({"mode": s.get("consistency"), "availability": availability_kept(s),
                     "consistency": consistency_kept(s), "others_busy_in_partition": others_busy_in_partition(s),
                     "divergence_relative_max": s.get("divergence_relative_max"),
                     "staleness_max": s.get("staleness_max"), "recovery_s": s.get("recovery_s"),
                     "final_loss": s.get("final_loss"), "run_dir": s.get("run_dir")})
    return rows
