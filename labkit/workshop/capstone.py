"""The capstone, "make this run fast": score each attempt from the run store and rank the attempts.

Participants start from ``configs/capstone_slow.yaml`` (2 processes on an emulated slow link) and walk the
optimisation flowchart by hand: each attempt is the baseline config plus a few overrides, launched under the
name ``capstone-<participant>-<n>`` and recorded in the run store. Everything here reads those records:

* :func:`score` — an attempt's steady-state tokens/s, counted only if the run finished, kept the rules (same
  processes, model, data, global batch, network and steps; no fault settings; local SGD synchronising at least
  every :data:`MAX_SYNC_EVERY` steps) and trained no worse than the baseline (loss within ``tolerance``,
  relative, as the flowchart's ``accept`` judges it); otherwise None and the reason;
* :func:`leaderboard` — every attempt beside the baseline, ranked by speed-up, with its config diff;
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
         "comm.bandwidth_gbps", "comm.latency_us", "comm.collective_algorithm", "fault.")
"""What an attempt may not change: the model, the data, the global batch, the length of the run, and the network
(the problem) — and no fault setting. A bigger global batch moves more tokens per step, so more tokens/s without
reaching the loss any sooner; ``fault.skip_steps`` drops updates, which is not speed."""
MAX_SYNC_EVERY = 16  # local SGD / DiLoCo must synchronise at least this often: once in a whole run is no training


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


def disqualified(record: dict, baseline: Optional[dict] = None, tolerance: float = LOSS_TOLERANCE) -> Optional[str]:
    """Why an attempt does not count, or None if it does."""
    if record.get("status") != "finished":
        return f"did not finish (status {record.get('status') or 'unknown'})"
    if not record.get("tokens_per_s"):
        return "finished without a measured throughput"
    loss = _loss(record)
    if loss is None:
        return "no finite final loss"
    if baseline is None:
        return None
    broken = [k for k in diff(baseline.get("config"), record.get("config")) if k.startswith(FIXED)]
    if broken:
        return (f"changed what is fixed: {', '.join(broken)} (the model, data, global batch, steps and network are "
                "the problem; fault settings are not an optimisation)")
    too_rare = rare_synchronisation(record.get("config"))
    if too_rare:
        return too_rare
    if record.get("world_size") != baseline.get("world_size"):
        return f"{record.get('world_size')} processes, the baseline ran {baseline.get('world_size')}"
    base = _loss(baseline)
    if base is not None and loss > base + tolerance * abs(base):
        return f"trains worse: loss {loss:.4f} against the baseline's {base:.4f} (more than {tolerance:.0%} worse)"
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
    """``(steady-state tokens/s, "counts")``, or ``(None, why not)``: see :func:`disqualified`."""
    why = disqualified(record, baseline, tolerance)
    return (None, why) if why else (float(record["tokens_per_s"]), "counts")


def comm_share(record: dict) -> tuple[Optional[float], str]:
    """The communication share the flowchart decides on: exposed, else in flight (and which one it is)."""
    if record.get("comm_exposed_frac") is not None:
        return record["comm_exposed_frac"], "exposed"
    return record.get("comm_frac"), "in flight"


def summary_text(record: dict) -> str:
    """One run's numbers, from its run-store record: status, throughput, communication, utilisation, loss."""
    share, kind = comm_share(record)
    return (f"{record['name']} ({record['id']}): {record.get('status')} after {record.get('steps')} steps on "
            f"{record.get('world_size')} processes; {_num(record.get('tokens_per_s'), ',.0f')} tokens/s (steady "
            f"state); communication {_num(share, '.0%')} of the step {kind} (in flight "
            f"{_num(record.get('comm_frac'), '.0%')}); MFU {_num(record.get('mfu'), '.1%')}; final loss "
            f"{_num(_loss(record), '.4f')}")


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
    return [baseline] + [store.get_run(i) for i in ids]


def rank_rows(records: list[dict], tolerance: float = LOSS_TOLERANCE) -> list[dict]:
    """Leaderboard rows from records (the baseline first): qualified by speed-up, fastest first, then the rest."""
    baseline, rows = records[0], []
    base_rate = baseline.get("tokens_per_s") or 0.0
    for i, record in enumerate(records):
        value, why = score(record, None if i == 0 else baseline, tolerance)
        share, share_kind = comm_share(record)
        rate = record.get("tokens_per_s")
        rows.append({"id": record["id"], "name": record.get("name"), "baseline": i == 0,
                     "participant": "baseline" if i == 0 else participant_of(record.get("name")),
                     "changes": {} if i == 0 else diff(baseline.get("config"), record.get("config")),
                     "score": value, "tokens_per_s": rate, "loss": _loss(record), "comm_share": share,
                     "comm_kind": share_kind, "mfu": record.get("mfu"), "qualified": value is not None,
                     "reason": why, "speedup": rate / base_rate if rate and base_rate else None})
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
    head = ["#", "attempt", "changes", "tokens/s", "speed-up", "communication", "loss", "verdict"]
    lines = [f'<table style="font-size:{font_px}px;border-collapse:collapse">',
             "<tr>" + "".join(f'<th style="{cell}">{h}</th>' for h in head) + "</tr>"]
    for r in rows:
        color = "#2E8B57" if r["qualified"] else "#C44E52"
        verdict = "baseline" if r["baseline"] else "counts" if r["qualified"] else f"disqualified: {r['reason']}"
        share = f"{_num(r['comm_share'], '.0%')} {r['comm_kind']}"
        speed = "1.00×" if r["baseline"] else _num(r["speedup"], ".2f") + ("×" if r["speedup"] else "")
        changes = "—" if r["baseline"] else changes_text(r["changes"])
        values = [r["rank"] or "–", f"{r['participant']} ({r['name']})", changes,
                  _num(r["tokens_per_s"], ",.0f"), speed, share,
                  _num(r["loss"], ".4f"), verdict]
        style = "" if r["qualified"] else ";color:#777"
        lines.append(f'<tr style="border-left:6px solid {color}{style}">'
                     + "".join(f'<td style="{cell}">{html.escape(str(v))}</td>' for v in values) + "</tr>")
    return "\n".join(lines + ["</table>"])


def run_attempt(config, overrides: dict, name: str, store, nproc: int = 2):
    """Launch ``config`` with ``overrides`` as run ``name`` on ``nproc`` processes, wait, record it; the Run."""
    from labkit.launcher import launch

    run = launch(config.replace(**{**overrides, "run.name": name}), nproc=nproc)
    run.wait()
    store.record_run(run.run_dir)
    return run
