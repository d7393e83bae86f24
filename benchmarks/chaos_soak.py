"""A chaos soak at length: 4 gloo processes, ≥ 30 faults of every kind in one run, predicted before it starts.

:func:`labkit.soak.soak_experiment` measures what a clean step, a checkpoint save and a restart cost (a
reference run without the faults, a run with one crash), predicts the soak's useful fraction from them and the
plan (Young and Daly's terms, fault by fault: :func:`labkit.fault.chaos.predicted_soak`), runs the soak with its
kills from outside, and checks it: the final model bit for bit the reference's (the same dropped updates), every
fault on record with its detection and recovery, the measured useful fraction beside the predicted (the target:
within 5 points; the bound: ≥ 30 faults in ≤ 15 minutes).

Results: ``benchmarks/results/chaos_soak.jsonl`` — a row per fault (``chaos_soak_faults``) and the summary
(``chaos_soak``: predicted and measured, each term, the costs, held or missed).

    .venv/bin/python benchmarks/chaos_soak.py [--faults 32] [--every 55] [--seed 1]
    .venv/bin/python benchmarks/chaos_soak.py --quick     # 6 faults: what the test runs
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from labkit.config import ConfigError, load_config
from labkit.fault.chaos import ENDS_ATTEMPT
from labkit.soak import fault_table, soak_experiment
from labkit.results import results_path, write_results
from labkit.validation import validate

NAME = "chaos_soak"
NPROC = 4
TARGET_POINTS = 5.0  # measured useful fraction within 5 points of the predicted
FULL = {"faults": 32, "every": 55.0, "steps": 2000, "bound_s": 15 * 60,
        "model": {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 64}}
QUICK = {"faults": 6, "every": 16.0, "steps": 150, "bound_s": 3 * 60,
         "model": {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32}}
RUN = {"data.batch_size": 16, "data.micro_batch_size": 4, "optim.warmup_steps": 2, "run.eval_every": 0, "run.seed": 7}


def soak_config(size: dict, seed: int):
    return load_config(None, {**RUN, **size["model"], "run.name": "chaos-soak", "run.steps": size["steps"],
                              "fault.checkpoint_every": 10, "fault.keep_last": 3,
                              "fault.max_restarts": size["faults"], "fault.chaos_faults": size["faults"],
                              "fault.chaos_every": size["every"], "fault.chaos_seed": seed,
                              "fault.straggler_ms": 100.0, "fault.straggler_steps": 5, "comm.timeout_s": 8.0,
                              "metrics.alerts": False, "metrics.progress": False,
                              "parallel.dp.strategy": "ddp_bucketed"})  # bit for bit after a resume at dp 4


def summary_row(record: dict, size: dict) -> dict:
    predicted, measured = record["predicted"], record["measured"]
    table = fault_table(record)
    restarts = [r for r in table if r["kind"] in ENDS_ATTEMPT]
    held = {"points": record["points_apart"] <= TARGET_POINTS, "bitwise": record["bitwise_equal"],
            "count": len(table) >= size["faults"], "bound": record["soak_s"] <= size["bound_s"],
            "on_record": all(r["on_record"] for r in table),
            "seen_and_recovered": all(r["detected_s"] is not None and r["recovery_s"] for r in restarts)}
    return {"check": "chaos soak: measured useful fraction vs predicted", "faults": len(table),
            "kinds": sorted({r["kind"] for r in table}), "restarts": len(restarts),
            "predicted_useful_fraction": predicted["useful_fraction"], "measured_useful_fraction":
            measured["useful_fraction"], "points_apart": record["points_apart"], "target_points": TARGET_POINTS,
            "predicted_wall_s": predicted["wall_s"], "measured_wall_s": measured["wall_s"],
            "wall_predicted_vs_measured": predicted["wall_s"] / measured["wall_s"],
            "predicted_terms_s": predicted["terms_s"], "costs": record["costs"], "soak_s": record["soak_s"],
            "bound_s": size["bound_s"], "bitwise_equal": record["bitwise_equal"], "equality": record["equality"],
            "dropped_updates": measured["dropped_updates"], "held": all(held.values()), "held_each": held}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 faults over 150 steps (the test's soak)")
    parser.add_argument("--faults", type=int)
    parser.add_argument("--every", type=float, help="mean steps between faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", help="keep the run directories here")
    args = parser.parse_args(argv)
    size = {**(QUICK if args.quick else FULL), **{k: v for k, v in (("faults", args.faults), ("every", args.every))
                                                  if v is not None}}
    cfg = soak_config(size, args.seed)
    try:
        validate(cfg, nproc=NPROC)  # the plan fits, the ladder holds: before any worker starts
    except ConfigError as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory(prefix="labkit-chaos-") as tmp:
        record = soak_experiment(cfg, NPROC, Path(args.keep or tmp), timeout_s=size["bound_s"] + 600)
    row = summary_row(record, size)
    print(f"  useful fraction: measured {row['measured_useful_fraction']:.3f}, predicted "
          f"{row['predicted_useful_fraction']:.3f} ({row['points_apart']:.1f} points apart, target "
          f"{TARGET_POINTS:g}): {'held' if row['held_each']['points'] else 'MISSED'}; {row['faults']} faults, "
          f"{row['restarts']} restarts in {row['soak_s']:.0f} s; final model: {row['equality']}")
    settings = {**size, "seed": args.seed, "quick": args.quick, "nproc": NPROC, "config": cfg.to_dict()["fault"]}
    write_results(NAME, fault_table(record), settings, table="chaos_soak_faults")
    write_results(NAME, [row], settings, table="chaos_soak")
    print(f"results: appended to {results_path(NAME)}")


if __name__ == "__main__":
    main()
