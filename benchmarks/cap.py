"""The CAP trade-off measured: the four consistency models under one partition, side by side.

Each mode trains configs/cap_tradeoffs.yaml (2 workers; ssp / async add a parameter-server process)
for ``--duration`` seconds with worker 1 cut off from ``--start`` for ``--length`` seconds, then a
second round with no partition and a 3× straggler. Printed per run: steps the other worker finished
and its computing share during the partition (availability), the largest replica divergence during it
and overall (consistency), the largest staleness, the recovery time after the heal, the final
validation loss, and the verdict written from those numbers. Both tables are appended to
``benchmarks/results/cap.jsonl``.

    .venv/bin/python benchmarks/cap.py [--duration 8] [--start 2.5] [--length 3]
"""
from __future__ import annotations

import argparse

import labkit
from labkit.consistency import processes_for
from labkit.consistency.report import others_busy_in_partition, verdict
from labkit.results import write_results

MODES = ("sync", "local_sgd", "ssp", "async")


def run(config, mode: str, **settings) -> dict:
    r = labkit.launch(config.replace(**{"comm.consistency": mode, **settings}), nproc=processes_for(mode, 2))
    assert r.wait() == "finished", r.log()[-2000:]
    return r.summary


def partition_row(mode: str, s: dict) -> dict:
    """One mode under the partition: availability, consistency, recovery, loss and the verdict in words."""
    return {"mode": mode, "others_steps": sum(n for r, n in s["steps_in_partition"].items() if int(r) != 1),
            "others_busy": others_busy_in_partition(s), "divergence_in_partition": s.get("divergence_max_in_partition"),
            "divergence_max": s["divergence_max"], "staleness_max": s.get("staleness_max"),
            "recovery_s": s["recovery_s"], "final_loss": s["final_loss"],
            "verdict": verdict(s).replace("<b>", "").replace("</b>", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--start", type=float, default=2.5)
    parser.add_argument("--length", type=float, default=3.0)
    args = parser.parse_args()
    config = labkit.load_config("configs/cap_tradeoffs.yaml").replace(**{
        "comm.duration_s": args.duration, "run.name": "cap-bench"})
    print(f"partition of worker 1 from {args.start:g} s for {args.length:g} s in a {args.duration:g} s run, "
          f"2 workers, plain SGD; ssp s={config.comm.staleness}, local_sgd H={config.comm.sync_every}")
    print(f"{'mode':>9} {'others: steps':>13} {'busy':>5} {'div. in part.':>13} {'div. max':>9} {'stale max':>9} "
          f"{'recovery':>9} {'loss':>6}")
    rows = []
    for mode in MODES:
        s = run(config, mode, **{"comm.partition_rank": 1, "comm.partition_start_s": args.start,
                                 "comm.partition_s": args.length})
        rows.append(partition_row(mode, s))
        r, inside = rows[-1], rows[-1]["divergence_in_partition"]
        print(f"{mode:>9} {r['others_steps']:>13} {r['others_busy']:>5.0%} "
              f"{'-' if inside is None else f'{inside:.3f}':>13} {r['divergence_max']:>9.3f} "
              f"{str(s.get('staleness_max', '-')):>9} {r['recovery_s'] or float('nan'):>8.2f}s {r['final_loss']:>6.3f}")
    print()
    for r in rows:
        print(r["verdict"])
    settings = {"duration_s": args.duration, "partition_start_s": args.start, "partition_s": args.length,
                "staleness": config.comm.staleness, "sync_every": config.comm.sync_every}
    print(f"results: appended to {write_results('cap', rows, settings, table='partition')}")
    print("\nno partition, the last worker 3× slower: steps/s per worker")
    stragglers = []
    for mode, extra in (("sync", {}), ("ssp", {"comm.staleness": 4}), ("async", {})):
        slow = 1 if mode == "sync" else 2
        s = run(config, mode, **{"comm.partition_s": 0.0, "comm.partition_rank": None, "comm.slow_rank": slow,
                                 "comm.slow_factor": 3.0, **extra})
        stragglers.append({"mode": mode, "staleness_bound": extra.get("comm.staleness"), "slow_rank": slow,
                           "steps_per_s": {r: a["steps_per_s"] for r, a in s["availability"].items()},
                           "staleness_max": s.get("staleness_max"), "final_loss": s["final_loss"]})
        rates = ", ".join(f"rank {r}: {a['steps_per_s']:.1f}" for r, a in s["availability"].items())
        print(f"{mode:>9}{' s=4' if mode == 'ssp' else '':4}: {rates}; max staleness {s.get('staleness_max', '-')}, "
              f"final loss {s['final_loss']:.3f}")
    settings = {"duration_s": args.duration, "slow_factor": 3.0}
    print(f"results: appended to {write_results('cap', stragglers, settings, table='straggler')}")


if __name__ == "__main__":
    main()
