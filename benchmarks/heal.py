"""Live healing (torchft) beside labkit's restart path: one replica SIGKILLed, on the same ~10M-parameter GPT.

Each round runs :func:`labkit.fault.heal.heal_run` twice (2 replica groups of one process on a lighthouse at
127.0.0.1, the victim killed at a step and restarted at once: as a new process, and as a warm standby, its imports
done and its model built, told to go) and reads its recovery split: detect, respawn, quorum, transfer, rejoin, the
total from the kill to the first step with every group again, and the steps the healthy group committed meanwhile.
The target: under 5 s from kill to rejoined in every round, the other group never stopping (it commits steps
while the victim is away: the quorum, and a heal in it, run beside each step's compute, torchft's asynchronous
quorum).

Beside it, the restart path on the same model (``--no-restart`` skips it): a labkit run of 2 processes (DDP over
gloo) SIGKILLed from outside at one step (:func:`labkit.soak.run_chaos`); every worker restarts from the last
checkpoint and :func:`labkit.fault.recovery.recovery_report` gives detection, recovery (fault → first step after the
resume) and the steps done again; no worker steps while they restart.

Results: ``benchmarks/results/heal.jsonl`` (tables ``heal_rounds``, ``restart_rounds`` and ``heal``, the medians).

    .venv/bin/python benchmarks/heal.py [--rounds 6] [--no-restart]   # needs the ft extra: pip install -e '.[ft]'
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from labkit.fault.heal import M10, HealSpec, heal_run
from labkit.results import results_path, write_results

NAME = "heal"
TARGET_S = 5.0  # kill → rejoined
SPLIT = ("detect_s", "respawn_s", "quorum_s", "transfer_s", "rejoin_s", "total_s", "healthy_steps_meanwhile",
         "healthy_steps_dropped", "healthy_longest_gap_s")


def heal_rounds(rounds: int, standby: bool, root: Path) -> list[dict]:
    spec = HealSpec(kill_at=4, solo_steps=0, steps_after=3, standby=standby, model=dict(M10), batch=4)
    rows = []
    for r in range(rounds):
        split = heal_run(spec, root / f"heal-{r}", timeout_s=600)
        rows.append({"round": r, "standby": standby, **split, "held": split["total_s"] < TARGET_S})
        print(f"  heal round {r}: " + ", ".join(f"{k} {split[k]}" if split[k] is None else f"{k} {split[k]:.2f}"
                                               for k in SPLIT), flush=True)
    return rows


def restart_rounds(rounds: int, root: Path) -> list[dict]:
    """The same kill under labkit's restart path: the launcher's elastic agent restarts both workers."""
    from labkit.config import load_config
    from labkit.fault.recovery import recovery_report
    from labkit.soak import run_chaos

    model = {f"model.{k}": v for k, v in M10.items()}
    cfg = load_config(None, {**model, "run.name": "heal-restart", "run.steps": 16, "run.eval_every": 0,
                             "run.seed": 7, "data.batch_size": 8, "data.micro_batch_size": 4,
                             "optim.warmup_steps": 2, "fault.checkpoint_every": 4, "fault.max_restarts": 1,
                             "fault.chaos_faults": 1, "fault.chaos_kinds": ["kill"], "fault.chaos_every": 8.0,
                             "fault.chaos_seed": 0, "metrics.alerts": False, "metrics.progress": False})
    rows = []
    for r in range(rounds):
        run = run_chaos(cfg, 2, run_dir=root / f"restart-{r}", timeout_s=600)
        fault = recovery_report(run.run_dir)[0]
        rows.append({"round": r, "detected_s": fault["detected_s"], "recovery_s": fault["recovery_s"],
                     "steps_recomputed": fault["steps_recomputed"], "step": fault.get("step")})
        print(f"  restart round {r}: detected {fault['detected_s']}, recovery {fault['recovery_s']:.2f} s, "
              f"{fault['steps_recomputed']} steps again", flush=True)
    return rows


def summary(heal: list[dict], restart: list[dict], standby: bool) -> dict:
    row = {"check": f"kill → rejoined, {'warm standby' if standby else 'new process'}", "standby": standby,
           **{f"median_{k}": _median([r[k] for r in heal]) for k in SPLIT}}
    row.update(rounds=len(heal), target_s=TARGET_S, rounds_held=sum(r["held"] for r in heal),
               held=all(r["held"] for r in heal),  # every round under the target, not only the median
               healthy_never_stopped=all(r["healthy_steps_meanwhile"] > 0 for r in heal),
               bitwise=all(r["healed_equal_to_sender"] and r["final_equal"] for r in heal))
    if restart:
        row.update(restart_rounds=len(restart), median_restart_recovery_s=statistics.median(
            r["recovery_s"] for r in restart), median_restart_steps_recomputed=statistics.median(
            r["steps_recomputed"] for r in restart))
    return row


def _median(values: list) -> float | None:
    """The median of the values measured (detection is None in a round the healthy group never noticed)."""
    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-restart", action="store_true", help="skip the restart path's rounds")
    parser.add_argument("--keep", help="keep the run directories here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="labkit-heal-") as tmp:
        root = Path(args.keep or tmp)
        heal = {standby: heal_rounds(args.rounds, standby, root / ("standby" if standby else "new"))
                for standby in (False, True)}
        restart = [] if args.no_restart else restart_rounds(args.rounds, root)
    settings = {"rounds": args.rounds, "model": M10, "replicas": 2, "async_quorum": HealSpec().async_quorum,
                "load_average_at_start": load,
                "load_average_at_end": os.getloadavg()[0], "cores": os.cpu_count()}
    rows = [summary(heal[standby], restart, standby) for standby in (False, True)]
    for row in rows:
        print(f"  {row['check']}: median {row['median_total_s']:.2f} s, {row['rounds_held']} of {row['rounds']} rounds "
              f"under {TARGET_S:g} s ({'held' if row['held'] else 'MISSED'}); the healthy group committed "
              f"{row['median_healthy_steps_meanwhile']:g} steps meanwhile, its longest wait "
              f"{row['median_healthy_longest_gap_s']:.2f} s" + (f"; the restart path: "
                                                               f"{row['median_restart_recovery_s']:.2f} s, "
                                                               f"{row['median_restart_steps_recomputed']:g} steps "
                                                               f"again" if restart else ""))
    write_results(NAME, heal[False] + heal[True], settings, table="heal_rounds")
    if restart:
        write_results(NAME, restart, settings, table="restart_rounds")
    write_results(NAME, rows, settings, table="heal")
    print(f"results: appended to {results_path(NAME)}")


if __name__ == "__main__":
    main()
