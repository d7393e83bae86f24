"""Checkpoints: save and load time and size vs model size, sync vs async save, recovery after a crash.

2 gloo processes per run. For each model size, one run saves synchronously and has rank 1 crash
(the elastic agent restarts the group, which resumes from the newest checkpoint); a second run
saves asynchronously and does not crash. Reported per size:

* size — bytes on disk of one checkpoint (model + AdamW state, sharded as the strategy shards);
* sync save — how long training was blocked by a synchronous save (write + manifest + rename);
* async blocked — how long training was blocked by an async save (the copy to CPU memory);
* async written — from the save's start until the background thread had written every file
  (training ran meanwhile; slower than a sync save here: the thread competes with training for 2 cores);
* load — reading the newest valid checkpoint on resume;
* recovery — crash → first training step after the resume (restart, rendezvous, load included).

The table is appended to ``benchmarks/results/checkpoint.jsonl``.

    .venv/bin/python benchmarks/checkpoint.py [--sizes 64,128,256] [--strategy torch_ddp]
"""
from __future__ import annotations

import argparse
import statistics

import labkit
from labkit.metrics.events import read_events
from labkit.results import write_results

STEPS, EVERY, CRASH_AT = 16, 4, 10


def events(run, kind: str) -> list[dict]:
    return [e for e in read_events(run.run_dir / "events.jsonl")[0] if e["type"] == kind]


def measure(config, n_embd: int, strategy: str) -> dict:
    base = config.replace(**{"model.n_embd": n_embd, "parallel.dp.strategy": strategy})
    crashed = labkit.launch(base.replace(**{"fault.inject": "crash", "fault.inject_rank": 1,
                                            "fault.inject_step": CRASH_AT}), nproc=2)
    assert crashed.wait() == "finished", crashed.log()[-3000:]
    background = labkit.launch(base.replace(**{"fault.async_save": True}), nproc=2)
    assert background.wait() == "finished", background.log()[-3000:]
    sync_saves, async_saves = events(crashed, "checkpoint"), events(background, "checkpoint")
    (resume,) = events(crashed, "resume")
    (fault,) = crashed.summary["faults"]
    return {"params": crashed.summary["params"]["total"], "bytes": sync_saves[-1]["bytes"],
            "sync_s": statistics.median(s["blocking_s"] for s in sync_saves),
            "async_blocked_s": statistics.median(s["blocking_s"] for s in async_saves),
            "async_total_s": statistics.median(s["written_s"] for s in async_saves),
            "load_s": resume["load_s"], "recovery_s": fault["recovery_s"],
            "recomputed": fault["steps_recomputed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,128,256", help="model widths (n_embd) to compare")
    parser.add_argument("--strategy", default="torch_ddp")
    args = parser.parse_args()
    config = labkit.load_config("configs/quickstart.yaml").replace(**{
        "run.steps": STEPS, "run.eval_every": 0, "run.save_final": False, "metrics.progress": False,
        "model.n_layer": 4, "fault.checkpoint_every": EVERY, "fault.max_restarts": 1, "fault.keep_last": 2,
        "run.runs_dir": "/tmp/labkit-bench-runs"})
    print(f"2 processes, {args.strategy}, AdamW, 4 layers; save every {EVERY} steps; rank 1 crashes at step "
          f"{CRASH_AT}; medians over the run's saves\n")
    print(f"{'n_embd':>6s} {'params':>9s} {'size MB':>8s} {'sync save':>10s} {'async blocked':>14s} "
          f"{'async written':>13s} {'load':>7s} {'recovery':>9s} {'recomputed':>10s}")
    rows = []
    for n_embd in map(int, args.sizes.split(",")):
        r = measure(config, n_embd, args.strategy)
        rows.append({"n_embd": n_embd, **r})
        print(f"{n_embd:6d} {r['params']:9,d} {r['bytes'] / 1e6:8.2f} {1e3 * r['sync_s']:8.1f}ms "
              f"{1e3 * r['async_blocked_s']:12.1f}ms {1e3 * r['async_total_s']:11.1f}ms {1e3 * r['load_s']:5.0f}ms "
              f"{r['recovery_s']:8.1f}s {r['recomputed']:10d}")
    settings = {"sizes": args.sizes, "strategy": args.strategy, "nproc": 2, "n_layer": 4, "steps": STEPS,
                "checkpoint_every": EVERY, "crash_at": CRASH_AT}
    print(f"results: appended to {write_results('checkpoint', rows, settings, table='checkpoint')}")


if __name__ == "__main__":
    main()
