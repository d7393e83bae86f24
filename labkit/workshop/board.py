"""A class leaderboard across laptops: each participant submits attempts from their own run store, the instructor
merges the submissions.

Laptops differ, so times do not compare across them; a **speed-up over the same baseline run on the same
machine** (its time to the target validation loss over the attempt's) does. A submission (:func:`submission`)
carries the attempt's run-store record, the baseline's from the same store (each with its evaluations), the
machine they ran on, and the score the participant saw. The instructor's board
(:func:`merged_rows`) scores every attempt again against its own baseline with :func:`labkit.workshop.capstone.score`
— a submission's own claim is never taken — and ranks the class by speed-up; the same attempt submitted twice
counts once.

    labkit workshop submit --baseline BASELINE_ID --attempt RUN_ID --to /shared/capstone   # each participant
    labkit workshop leaderboard /shared/capstone                                          # the instructor
    labkit workshop leaderboard --hub .hub            # under make hub: every seat's run store, no submitting

Under ``make hub`` the seats' run stores sit on the instructor's machine: :func:`hub_entries` reads every seat's
newest baseline and its capstone attempts as if each had been submitted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from labkit.workshop.capstone import (BASELINE_NAME, LOSS_TOLERANCE, attempts, changes_text, diff, participant_of,
                                     score, speedup, with_evals)

FORMAT = 2  # a submission file's format: a board refuses any other
KEPT = ("id", "name", "status", "config", "tokens_per_s", "final_loss", "val_loss", "world_size", "mfu", "comm_frac",
        "comm_exposed_frac", "steps", "hardware", "created", "evals")  # what a record carries to the board


def trimmed(record: dict) -> dict:
    return {key: record.get(key) for key in KEPT}


def submission(store, baseline_id: str, attempt_id: str) -> dict:
    """One attempt from ``store``, with the baseline it is judged against and the machine both ran on."""
    baseline, attempt = (with_evals(store, store.get_run(run_id)) for run_id in (baseline_id, attempt_id))
    value, why = score(attempt, baseline)
    return {"format": FORMAT, "participant": participant_of(attempt.get("name")), "attempt": trimmed(attempt),
            "baseline": trimmed(baseline), "machine": (attempt.get("hardware") or {}).get("cpu_model"),
            "claimed_score": value, "claimed_reason": why}


def write_submission(entry: dict, directory) -> Path:
    """``DIR/<participant>-<attempt id>.json`` (written whole, then renamed: a board never reads half a file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{entry['participant']}-{entry['attempt']['id']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(entry, indent=1))
    partial.replace(path)
    return path


def read_submissions(directory) -> tuple[list[dict], list[str]]:
    """Every submission file in ``directory``, and a line for each file that is not one (skipped, not fatal)."""
    entries, problems = [], []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            problems.append(f"{path.name}: not readable JSON ({error})")
            continue
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or not {"attempt", "baseline"} <= set(entry):
            problems.append(f"{path.name}: not a labkit capstone submission (format {FORMAT})")
            continue
        entries.append(entry)
    return entries, problems


def store_entries(store) -> list[dict]:
    """Every capstone attempt in one run store, as submissions against the store's newest baseline run."""
    baselines = store.list_runs(limit=1, name=BASELINE_NAME)
    if not baselines:
        return []
    base_id = baselines[0]["id"]
    return [submission(store, base_id, record["id"]) for record in attempts(store, base_id)[1:]]


def hub_entries(state_dir) -> tuple[list[dict], list[str]]:
    """The entries of every seat of the hub in ``state_dir`` (``make hub``'s ``.hub``), and a line per seat with
    no baseline run yet."""
    from labkit.hub import seat_stores
    from labkit.metrics.store import RunStore

    entries, problems = [], []
    for user, path in seat_stores(state_dir).items():
        with RunStore(path) as store:
            found = store_entries(store)
        entries += found
        if not found:
            problems.append(f"seat {user}: no {BASELINE_NAME} run with attempts in {path}")
    return entries, problems


def merged_rows(entries: list[dict], tolerance: float = LOSS_TOLERANCE) -> list[dict]:
    """A row per distinct attempt, scored again against its own baseline: qualified ones by speed-up, fastest
    first, then the rest with their reasons."""
    seen, rows = set(), []
    for entry in entries:
        attempt, baseline = entry["attempt"], entry["baseline"]
        if attempt["id"] in seen:
            continue
        seen.add(attempt["id"])
        value, why = score(attempt, baseline, tolerance)
        base_value, _ = score(baseline, None, tolerance)
        rows.append({"participant": entry["participant"], "attempt": attempt["name"], "id": attempt["id"],
                     "machine": entry.get("machine"), "qualified": value is not None, "reason": why,
                     "speedup": speedup(value, base_value), "time_to_target_s": value,
                     "baseline_time_to_target_s": base_value, "tokens_per_s": attempt.get("tokens_per_s"),
                     "changes": changes_text(diff(baseline.get("config"), attempt.get("config")))})
    rows.sort(key=lambda r: (not r["qualified"], -(r["speedup"] or 0.0)))
    for n, row in enumerate(rows):
        row["rank"] = n + 1 if row["qualified"] else None
    return rows


def board_text(rows: list[dict], problems: Optional[list[str]] = None) -> str:
    """The merged board as text: rank, participant, speed-up over their own baseline, machine, changes."""
    lines = [f"{'#':>3}  {'participant':12s} {'speed-up':>8s}  {'machine':22s} changes / verdict"]
    for r in rows:
        speed = f"{r['speedup']:.2f}×" if r["speedup"] else "–"
        verdict = r["changes"] if r["qualified"] else f"disqualified: {r['reason']}"
        lines.append(f"{r['rank'] or '–':>3}  {r['participant'][:12]:12s} {speed:>8s}  "
                     f"{(r['machine'] or 'unknown')[:22]:22s} {verdict}")
    return "\n".join(lines + [f"skipped {p}" for p in problems or []])
