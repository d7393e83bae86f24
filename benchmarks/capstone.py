"""The capstone's reference attempts, measured: how much each of the attempts labs.md expects outcomes for
(:data:`labkit.workshop.capstone.REFERENCE_ATTEMPTS`) speeds up ``configs/capstone_slow.yaml``, by the capstone's
own score — the training seconds to the target validation loss (:func:`labkit.workshop.capstone.score`).

Each round runs the baseline and every attempt, 2 processes each, in an order rotated from round to round; an
attempt's speed-up in a round is that round's baseline time to the target over the attempt's. A round where the
attempt is disqualified (it never reached the target, say) gives no speed-up and its reason is kept. labs.md's
table of the reference attempts is rendered from the newest record (``reference_table``; a test checks it).

Results: ``benchmarks/results/capstone.jsonl`` — a row per attempt (every round's time, tokens/s, validation loss
and verdict; the speed-up's median, IQR and verdict).

    .venv/bin/python benchmarks/capstone.py [--rounds 6]      # about 3 minutes a round on a 2-core laptop
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from labkit.config import load_config
from labkit.metrics.store import RunStore
from labkit.results import write_results
from labkit.rounds import MIN_ROUNDS, describe, ratio_summary
from labkit.workshop import capstone
from labkit.workshop.exercises import repo_root

NAME = "capstone"


def one_run(config, overrides: dict, name: str, store) -> dict:
    run = capstone.run_attempt(config, overrides, name, store)
    return capstone.with_evals(store, store.get_run(Path(run.run_dir).name))


def measure_round(config, n: int, store) -> dict:
    """Every attempt and the baseline once, the order rotated by ``n``; ``{attempt: record}`` (None: baseline)."""
    names = [None, *capstone.REFERENCE_ATTEMPTS]
    k = n % len(names)
    records = {}
    for attempt in names[k:] + names[:k]:
        overrides = capstone.REFERENCE_ATTEMPTS.get(attempt, {})
        run_name = capstone.BASELINE_NAME if attempt is None else capstone.attempt_name("ref", n * 100 + len(records))
        load = os.getloadavg()[0]
        records[attempt] = {**one_run(config, overrides, run_name, store), "load_1min_before": load}
        print(f"  round {n + 1}: {attempt or 'baseline'} done (load before {load:.2f})", flush=True)
    return records


def attempt_row(attempt: str, rounds: list[dict]) -> dict:
    per_round, speedups, reasons = [], [], []
    for records in rounds:
        base, record = records[None], records[attempt]
        base_s, _ = capstone.score(base)
        value, why = capstone.score(record, base)
        up = capstone.speedup(value, base_s)
        per_round.append({"time_to_target_s": value, "baseline_time_to_target_s": base_s, "speedup": up,
                          "reason": why, "tokens_per_s": record.get("tokens_per_s"),
                          "baseline_tokens_per_s": base.get("tokens_per_s"),
                          "val_loss": capstone.last_val_loss(record), "baseline_val_loss": capstone.last_val_loss(base),
                          "load_1min_before": record["load_1min_before"]})
        if up is not None:
            speedups.append(up)
        else:
            reasons.append(why)
    rates = [r["tokens_per_s"] / r["baseline_tokens_per_s"] for r in per_round
             if r["tokens_per_s"] and r["baseline_tokens_per_s"]]
    row = {"attempt": attempt, "overrides": capstone.REFERENCE_ATTEMPTS[attempt], "per_round": per_round,
           "counted": len(speedups), "reasons": reasons, "tokens_per_s_ratio": statistics.median(rates)}
    if len(speedups) == len(rounds):
        row.update(ratio_summary(speedups, lower_is_faster=False))
        row["summary"] = describe(row, "speed-up")
    else:
        row.update({"n_rounds": len(rounds), "median": None, "verdict": None, "speedups": speedups})
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args(argv)
    config = load_config(repo_root() / "configs" / "capstone_slow.yaml").replace(**{"metrics.progress": False})
    started, rounds = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="labkit-capstone-") as tmp:
        config = config.replace(**{"run.runs_dir": str(Path(tmp) / "runs")})
        with RunStore(Path(tmp) / "store.sqlite") as store:
            for n in range(args.rounds):
                rounds.append(measure_round(config, n, store))
    rows = [attempt_row(attempt, rounds) for attempt in capstone.REFERENCE_ATTEMPTS]
    baseline = [{"time_to_target_s": capstone.score(r[None])[0], "tokens_per_s": r[None].get("tokens_per_s"),
                 "val_loss": capstone.last_val_loss(r[None]), "load_1min_before": r[None]["load_1min_before"]}
                for r in rounds]
    settings = {"rounds": args.rounds, "nproc": 2, "config": "configs/capstone_slow.yaml", "baseline": baseline,
                "steps": config.run.steps, "eval_every": config.run.eval_every, "wall_s": time.monotonic() - started}
    path = write_results(NAME, rows, settings, table=NAME)
    for row in rows:
        print(f"{row['attempt']}: " + (row.get("summary") or f"counted in {row['counted']} of {len(rounds)} rounds: "
                                       + "; ".join(sorted(set(row['reasons'])))))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
