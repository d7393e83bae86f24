"""The capstone, "make this run fast": score each attempt from the run store and rank the attempts.

Participants start from ``configs/capstone_slow.yaml`` (2 processes on an emulated slow link) and walk the
optimisation flowchart by hand: each attempt is the baseline config plus a few overrides, launched under the
name ``capstone-<participant>-<n>`` and recorded in the run store. Everything here reads those records:

* :func:`score` — an attempt's **time to the target validation loss**: the training seconds (the steps' own times,
  evaluation not counted) until its first evaluation at or under the target, the baseline's last validation loss
  plus the flowchart's tolerance. Counted only if the run finished and kept the rules (same processes, model, data,
  global batch, evaluation, network and steps; no fault settings; local SGD synchronising at least every
  :data:`MAX_SYNC_EVERY` steps); otherwise None and the reason. Tokens/s alone would reward a run that moves
  more tokens without learning sooner; the time to a loss does not;
* :func:`leaderboard` — every attempt beside the baseline, ranked by speed-up (the baseline's time to the target
  over the attempt's), with its config diff;
* :func:`leaderboard_html` — the table, legible on a projector.
"""
from __future__ import annotations

import html
import math
import re
from typing import Any, Optional

from labkit.tuning.flowchart import Measurement, Thresholds, flatten

TAG = "capstone"
BASELINE_NAME = f"{TAG}-baseline"
LOSS_TOLERANCE = Thresholds().loss_tolerance  # the flowchart's: at most 2% (relative) worse
QUICK_OVERRIDES = {"run.steps": 30}  # LABKIT_QUICK=1: a run of a few seconds
IGNORED = ("run.name", "run.runs_dir", "metrics.progress")  # bookkeeping, not an attempt's change
FIXED = ("model.", "data.dataset", "data.tokenizer", "data.val_fraction", "data.batch_size", "run.steps", "run.seed",
         "run.eval_every", "run.eval_batches", "run.eval_samples", "comm.bandwidth_gbps", "comm.latency_us",
         "comm.collective_algorithm", "fault.")
"""What an attempt may not change: the model, the data, the global batch, the length of the run, how it is
evaluated, and the network (the problem) — and no fault setting. A bigger global batch moves more tokens per step,
so more tokens/s without reaching the loss any sooner; ``fault.skip_steps`` drops updates, which is not speed."""
MAX_SYNC_EVERY = 16  # local SGD / DiLoCo must synchronise at least this often: once in a whole run is no training
REFERENCE_ATTEMPTS = {
    "local SGD every 8 (the notebook's pre-filled attempt)": {"comm.sync": "local_sgd", "comm.sync_every": 8},
    "bigger buckets": {"parallel.dp.bucket_mb": 25.0},
    "bf16 gradients on the wire": {"comm.compression": "bf16"},
    "top-k gradients": {"comm.compression": "topk"},
    "bigger micro-batches": {"data.micro_batch_size": 8},
}
"""The attempts labs.md and two_day.md expect outcomes for; ``benchmarks/capstone.py`` runs them against the
baseline in interleaved rounds and labs.md's table of them is rendered from its results (:func:`reference_table`)."""
REFERENCE_BEGIN = "<!-- capstone reference attempts: begin -->"
REFERENCE_END = "<!-- capstone reference attempts: end -->"


def attempt_name(participant: str, n: int) -> str:
    """``capstone-<participant>-<n>``: the run name the leaderboard finds an attempt by."""
    if not re.fullmatch(r"[a-z0-9_]+", participant or ""):
        raise ValueError(f"participant {participant!r}: use lower-case letters, digits and _ only (e.g. 'ada')")
    return f"{TAG}-{participant}-{int(n)}"


def participant_of(name: str) -> str:
    """The participant in an attempt's run name (``capstone-ada-3`` → ``ada``)."""
    match = re.fullmatch(rf"{TAG}-(.+)-(\d+)", name or "")
    return match[1] if match else name


def next_attempt_name(store, participant: str) -> str:
    """The participant's next unused attempt name in ``store``: ``capstone-<participant>-<n + 1>``."""
    prefix = attempt_name(participant, 0)[:-1]
    used = [r[0] for r in store.conn.execute("SELECT name FROM runs WHERE name LIKE ?", (prefix + "%",))]
    return attempt_name(participant, max([int(n[len(prefix):]) for n in used if n[len(prefix):].isdigit()] + [0]) + 1)


def diff(baseline_config: dict, attempt_config: dict) -> dict[str, tuple[Any, Any]]:
    """The keys an attempt changed: ``{dotted key: (baseline value, attempt value)}``, bookkeeping left out."""
    a, b = flatten(baseline_config or {}), flatten(attempt_config or {})
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if k not in IGNORED and a.get(k) != b.get(k)}


def _loss(record: dict) -> Optional[float]:
    loss = record.get("final_loss")
    return float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None


def eval_trajectory(step_times: list[tuple[int, float]], evals: list[tuple[int, float]]) -> list[list[float]]:
    """``[[step, validation loss, training seconds up to that step], …]``: each evaluation with the sum of the
    step times before it (evaluation itself not counted). Non-finite losses are kept as None."""
    rows, elapsed, times = [], 0.0, iter(sorted(step_times))
    pending = next(times, None)
    for step, loss in sorted(evals):
        while pending is not None and pending[0] <= step:
            elapsed += pending[1] or 0.0
            pending = next(times, None)
        finite = isinstance(loss, (int, float)) and math.isfinite(loss)
        rows.append([step, float(loss) if finite else None, elapsed])
    return rows


def with_evals(store, record: dict) -> dict:
    """A run-store record with its ``evals`` (:func:`eval_trajectory`), which the score is read from."""
    step_times = zip(*store.series(record["id"], "step_time_s"))
    return {**record, "evals": eval_trajectory(list(step_times), list(zip(*store.series(record["id"], "val_loss"))))}


def target_loss(baseline: dict, tolerance: float = LOSS_TOLERANCE) -> Optional[float]:
    """The validation loss an attempt must reach: the baseline's last, plus ``tolerance`` (relative)."""
    losses = [loss for _, loss, _ in baseline.get("evals") or [] if loss is not None]
    return losses[-1] + tolerance * abs(losses[-1]) if losses else None


def last_val_loss(record: dict) -> Optional[float]:
    """The run's last validation loss: from its evaluations, else the store's column."""
    losses = [loss for _, loss, _ in record.get("evals") or [] if loss is not None]
    return losses[-1] if losses else record.get("val_loss")


def time_to(evals: list, target: float) -> Optional[float]:
    """The training seconds to the first evaluation at or under ``target``; None if none is."""
    return next((seconds for _, loss, seconds in evals if loss is not None and loss <= target), None)


def disqualified(record: dict, baseline: Optional[dict] = None, tolerance: float = LOSS_TOLERANCE) -> Optional[str]:
    """Why an attempt does not count, or None if it does (the baseline, or a record judged alone, against itself)."""
    if record.get("status") != "finished":
        return f"did not finish (status {record.get('status') or 'unknown'})"
    if not record.get("tokens_per_s"):
        return "finished without a measured throughput"
    judge = record if baseline is None else baseline
    target = target_loss(judge, tolerance)
    if target is None:
        return f"no validation loss on record for {judge.get('name') or judge.get('id')} (the capstone evaluates)"
    if baseline is not None:
        broken = [k for k in diff(baseline.get("config"), record.get("config")) if k.startswith(FIXED)]
        if broken:
            return (f"changed what is fixed: {', '.join(broken)} (the model, data, global batch, evaluation, steps "
                    "and network are the problem; fault settings are not an optimisation)")
        too_rare = rare_synchronisation(record.get("config"))
        if too_rare:
            return too_rare
        if record.get("world_size") != baseline.get("world_size"):
            return f"{record.get('world_size')} processes, the baseline ran {baseline.get('world_size')}"
    if time_to(record.get("evals") or [], target) is None:
        losses = [loss for _, loss, _ in record.get("evals") or [] if loss is not None]
        best = f"its best {min(losses):.4f}" if losses else "no finite validation loss"
        return (f"never reached the target validation loss {target:.4f} (the baseline's last + {tolerance:.0%}): "
                f"{best}")
    return None


def rare_synchronisation(config: Optional[dict]) -> Optional[str]:
    """Why an attempt's replicas synchronise too rarely to count (``comm.sync`` other than every step, with
    ``comm.sync_every`` above :data:`MAX_SYNC_EVERY`), or None."""
    flat = flatten(config or {})
    sync, every = flat.get("comm.sync", "every_step"), flat.get("comm.sync_every")
    if sync in (None, "every_step") or every is None or every <= MAX_SYNC_EVERY:
        return None
    return (f"comm.sync={sync} every {every} steps: replicas that average at most once in {every} steps train apart; "
            f"an attempt must synchronise at least every {MAX_SYNC_EVERY} steps")


def score(record: dict, baseline: Optional[dict] = None,
          tolerance: float = LOSS_TOLERANCE) -> tuple[Optional[float], str]:
    """``(training seconds to the target validation loss, "counts")``, or ``(None, why not)``: see
    :func:`disqualified`. Lower is better."""
    why = disqualified(record, baseline, tolerance)
    if why:
        return None, why
    return time_to(record["evals"], target_loss(record if baseline is None else baseline, tolerance)), "counts"


def speedup(value: Optional[float], baseline_value: Optional[float]) -> Optional[float]:
    """The baseline's time to the target over the attempt's (> 1: the attempt got there sooner)."""
    return baseline_value / value if value and baseline_value else None


def comm_share(record: dict) -> tuple[Optional[float], str]:
    """The communication share the flowchart decides on: exposed, else in flight (and which one it is)."""
    if record.get("comm_exposed_frac") is not None:
        return record["comm_exposed_frac"], "exposed"
    return record.get("comm_frac"), "in flight"


def summary_text(record: dict) -> str:
    """One run's numbers, from its run-store record: status, throughput, communication, utilisation, losses."""
    share, kind = comm_share(record)
    return (f"{record['name']} ({record['id']}): {record.get('status')} after {record.get('steps')} steps on "
            f"{record.get('world_size')} processes; {_num(record.get('tokens_per_s'), ',.0f')} tokens/s (steady "
            f"state); communication {_num(share, '.0%')} of the step {kind} (in flight "
            f"{_num(record.get('comm_frac'), '.0%')}); MFU {_num(record.get('mfu'), '.1%')}; final loss "
            f"{_num(_loss(record), '.4f')}; validation loss {_num(last_val_loss(record), '.4f')}")


def measurement(record: dict) -> Measurement:
    """A run-store record as the flowchart's :class:`Measurement` (for ``classify`` and ``candidate_actions``)."""
    return Measurement(tokens_per_s=record["tokens_per_s"], mfu=record.get("mfu"), comm_frac=record.get("comm_frac"),
                       loss=_loss(record), comm_exposed_frac=record.get("comm_exposed_frac"))


def attempts(store, baseline_id: str) -> list[dict]:
    """The run-store records tagged ``capstone-…``, the baseline first; other runs of the baseline's name left out."""
    baseline = store.get_run(baseline_id)
    ids = [r[0] for r in store.conn.execute("SELECT id FROM runs WHERE name LIKE ? ESCAPE '\\' AND id != ? "
                                            "AND name != ? ORDER BY created, id",
                                            (f"{TAG}-%", baseline["id"], baseline["name"]))]
    return [with_evals(store, baseline)] + [with_evals(store, store.get_run(i)) for i in ids]


def rank_rows(records: list[dict], tolerance: float = LOSS_TOLERANCE) -> list[dict]:
    """Leaderboard rows from records (the baseline first): qualified by speed-up, fastest first, then the rest."""
    baseline, rows = records[0], []
    base_value, _ = score(baseline, None, tolerance)
    for i, record in enumerate(records):
        value, why = score(record, None if i == 0 else baseline, tolerance)
        share, share_kind = comm_share(record)
        rows.append({"id": record["id"], "name": record.get("name"), "baseline": i == 0,
                     "participant": "baseline" if i == 0 else participant_of(record.get("name")),
                     "changes": {} if i == 0 else diff(baseline.get("config"), record.get("config")),
                     "score": value, "tokens_per_s": record.get("tokens_per_s"), "val_loss": last_val_loss(record),
                     "comm_share": share, "comm_kind": share_kind, "mfu": record.get("mfu"),
                     "qualified": value is not None, "reason": why, "speedup": speedup(value, base_value)})
    rows.sort(key=lambda r: (not r["qualified"], -(r["speedup"] or 0.0) if r["qualified"] else 0.0))
    for n, row in enumerate(rows):
        row["rank"] = n + 1 if row["qualified"] else None
    return rows


def leaderboard(store, baseline_id: str, tolerance: float = LOSS_TOLERANCE) -> list[dict]:
    """Every capstone attempt in ``store`` against the baseline run ``baseline_id``, ranked (:func:`rank_rows`)."""
    return rank_rows(attempts(store, baseline_id), tolerance)


def changes_text(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a} → {b}" for k, (a, b) in changes.items()) or "nothing changed"


def _num(value: Any, form: str) -> str:
    return "n/a" if value is None else format(value, form)


def leaderboard_html(rows: list[dict], font_px: int = 18) -> str:
    """The leaderboard as an HTML table, one row per attempt, in a font legible on a projector (≥ 14 px)."""
    font_px = max(14, font_px)
    cell = "padding:6px 12px;border-bottom:1px solid #ccc;text-align:left;vertical-align:top"
    head = ["#", "attempt", "changes", "time to target", "speed-up", "tokens/s", "communication", "val loss",
            "verdict"]
    lines = [f'<table style="font-size:{font_px}px;border-collapse:collapse">',
             "<tr>" + "".join(f'<th style="{cell}">{h}</th>' for h in head) + "</tr>"]
    for r in rows:
        color = "#2E8B57" if r["qualified"] else "#C44E52"
        verdict = "baseline" if r["baseline"] else "counts" if r["qualified"] else f"disqualified: {r['reason']}"
        share = f"{_num(r['comm_share'], '.0%')} {r['comm_kind']}"
        speed = _num(r["speedup"], ".2f") + ("×" if r["speedup"] else "")
        changes = "—" if r["baseline"] else changes_text(r["changes"])
        values = [r["rank"] or "–", f"{r['participant']} ({r['name']})", changes,
                  _num(r["score"], ".1f") + (" s" if r["score"] is not None else ""), speed,
                  _num(r["tokens_per_s"], ",.0f"), share, _num(r["val_loss"], ".4f"), verdict]
        style = "" if r["qualified"] else ";color:#777"
        lines.append(f'<tr style="border-left:6px solid {color}{style}">'
                     + "".join(f'<td style="{cell}">{html.escape(str(v))}</td>' for v in values) + "</tr>")
    return "\n".join(lines + ["</table>"])


def reference_table(record: dict) -> str:
    """labs.md's table of the reference attempts, from a ``benchmarks/results/capstone.jsonl`` record: each
    attempt's speed-up over the same round's baseline (median, IQR, rounds), the rounds it counted in, and why not."""
    from labkit.results import describe_machine

    machine = describe_machine(record["machine"])
    loads = [r["load_1min_before"] for row in record["rows"] for r in row.get("per_round", [])
             if r.get("load_1min_before") is not None]
    load = f"; 1-minute load {min(loads):.1f}–{max(loads):.1f} before the runs" if loads else ""
    lines = [f"Measured by `benchmarks/capstone.py` at {record['commit'][:7]} on {machine}, "
             f"{record['settings']['rounds']} interleaved rounds{load} (every round in "
             "`benchmarks/results/capstone.jsonl`):",
             "", "| attempt | overrides | counted in | speed-up (median, IQR) | verdict | tokens/s vs baseline |",
             "|---|---|---|---|---|---|"]
    for row in record["rows"]:
        overrides = ", ".join(f"`{k}={v}`" for k, v in row["overrides"].items())
        speed = (f"{row['median']:.2f}× ({row['q1']:.2f}–{row['q3']:.2f})" if row.get("median") is not None
                 else "–")
        reasons = "; ".join(sorted(set(row["reasons"])))
        verdict = row.get("verdict") or (f"disqualified: {reasons}" if not row["counted"]
                                         else f"not every round counted: {reasons}")
        lines.append(f"| {row['attempt']} | {overrides} | {row['counted']} of {row['n_rounds']} | {speed} | "
                     f"{verdict} | {row['tokens_per_s_ratio']:.2f}× |")
    return "\n".join(lines)


def run_attempt(config, overrides: dict, name: str, store, nproc: int = 2):
    """Launch ``config`` with ``overrides`` as run ``name`` on ``nproc`` processes, wait, record it; the Run."""
    from labkit.launcher import launch

    run = launch(config.replace(**{**overrides, "run.name": name}), nproc=nproc)
    run.wait()
    store.record_run(run.run_dir)
    return run
