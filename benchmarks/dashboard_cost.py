"""What does the live dashboard cost the run it watches?

The dashboard draws in the notebook's process, on the same cores as the workers: on a 2-core machine every
CPU second it spends drawing is taken from a worker, and since the ranks step in lock-step, the other rank
waits for it. This benchmark runs the same 2-process run (notebook 00's configuration) with nothing
watching it (``bare``) and with a :class:`~labkit.widgets.dashboard.RunDashboard` following it
(``dashboard``), interleaved A B, B A, … so drifts in machine load hit both alike, and reports the
throughput ratio dashboard / bare per round (target ≥ 0.97: the dashboard costs at most 3%).

Throughput is the run summary's tokens/s (total tokens over total time of the steady-state steps, the
definition the dashboard's headline uses too). For the dashboard runs it also records the frames drawn while the
run went (``live_frames``; the last one is drawn after it) and the redraws skipped, the CPU seconds drawing took
(the painter's, at the lowest priority, and the last frame's) and the follow loop's own in this process, and the
median speed of the steps that overlapped a live redraw against the others' (the sawtooth: near 1, drawing no
longer shows in the curve). On a machine others load, compare the CPU seconds with the run's: a ratio within the
run-to-run noise cannot say more.
Each run's 1-minute load average is recorded before it starts.

    .venv/bin/python benchmarks/dashboard_cost.py [--rounds 4] [--steps 300] [--every 2] [--quick]

Each run appends its table to ``benchmarks/results/dashboard_cost.jsonl``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import labkit
from labkit.metrics.events import final_trajectory
from labkit.metrics.window import warmup_skip
from labkit.results import write_results
from labkit.widgets.dashboard import RunDashboard

VARIANTS = ("bare", "dashboard")
NPROC = 2
QUICK_MODEL = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
               "data.batch_size": 8, "data.micro_batch_size": 4}


def round_order(r: int) -> tuple[str, ...]:
    """A B, B A, A B, …: neither variant always goes first."""
    return VARIANTS if r % 2 == 0 else VARIANTS[::-1]


def benchmark_config(steps: int, runs_dir: str, quick: bool):
    cfg = labkit.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml"))
    return cfg.replace(**{"run.steps": steps, "run.runs_dir": runs_dir, "run.save_final": False,
                          "run.eval_every": 0 if quick else cfg.run.eval_every, **(QUICK_MODEL if quick else {})})


def overlap_ratio(events: list[dict], frames: list[tuple[float, float]]) -> float | None:
    """Median speed of the steady-state steps that overlapped a redraw over that of the others (None if either
    set is empty): below 1, drawing shows in the throughput curve.

    A step spans the time between its event and the previous one (``time`` is when rank 0 wrote it). Medians,
    so a few slow steps of another cause (an evaluation) do not decide it.
    """
    steps = final_trajectory(events)
    steps = steps[warmup_skip(len(steps)):]
    during, outside = [], []
    for before, step in zip(steps, steps[1:]):
        start, end = before["time"], step["time"]
        hit = any(a < end and b > start for a, b in frames)
        (during if hit else outside).append(end - start)
    if not during or not outside:
        return None
    return statistics.median(outside) / statistics.median(during)


def one_run(cfg, variant: str, every_s: float) -> dict:
    load = os.getloadavg()[0]
    began = time.perf_counter()
    run = labkit.launch(cfg, nproc=NPROC)
    row = {"variant": variant, "load_1min_before": load}
    if variant == "dashboard":
        dashboard = RunDashboard()
        dashboard.follow_in_background(run, every_s)
        dashboard.join()
        stats = dashboard.drawing_stats()
        ended = max(e["time"] for e in run.events() if e.get("type") == "step")
        live = [(a, b) for a, b in stats["intervals"] if a < ended]  # frames begun while the run went
        row.update(frames=stats["frames"], live_frames=len(live), skipped=stats["skipped"],
                   live_draw_cpu_s=stats["cpu_s"] - stats["final_cpu_s"], last_frame_cpu_s=stats["final_cpu_s"],
                   draw_wall_s=stats["wall_s"], follow_cpu_s=stats["follow_cpu_s"],
                   overlap_speed=overlap_ratio(run.events(), live))
    else:
        run.wait()
    summary = run.summary or {}
    if summary.get("status") != "finished":
        raise RuntimeError(f"the {variant} run ended {summary.get('status')}: {summary.get('error')}; "
                           f"see {run.run_dir}")
    return {**row, "tokens_per_s": summary["tokens_per_s"], "wall_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=float, default=2.0, help="the dashboard's redraw period (s)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round of 30 steps (for the tests)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.every = 1, 30, 0.5
    if args.rounds < 1 or args.steps < 20:
        parser.error("--rounds must be >= 1 and --steps >= 20")
    rows, rounds = [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        cfg = benchmark_config(args.steps, runs_dir, args.quick)
        print(f"{NPROC} processes, {cfg.model.n_layer} layers × {cfg.model.n_embd} wide, {args.steps} steps per run, "
              f"redraw every {args.every:g} s; {args.rounds} interleaved round(s)")
        for r in range(args.rounds):
            got = {v: one_run(cfg, v, args.every) for v in round_order(r)}
            for v in round_order(r):
                rows.append({"round": r + 1, **got[v]})
                d = got[v]
                extra = (f"  {d['live_frames']} live frame(s) ({d['skipped']} redraws skipped) drawn in "
                         f"{d['live_draw_cpu_s']:.2f} CPU s at nice 19, follow loop {d['follow_cpu_s']:.2f} CPU s; "
                         f"steps beside a redraw {_fmt(d['overlap_speed'])}× the others' speed"
                         if v == "dashboard" else "")
                print(f"round {r + 1} {v:9s} {got[v]['tokens_per_s']:9,.0f} tokens/s  "
                      f"load {got[v]['load_1min_before']:.2f}" + extra)
            rounds.append(got["dashboard"]["tokens_per_s"] / got["bare"]["tokens_per_s"])
    print(f"throughput ratio dashboard/bare: median {statistics.median(rounds):.3f} "
          f"(min {min(rounds):.3f}, max {max(rounds):.3f}); target >= 0.97")
    settings = {**vars(args), "nproc": NPROC, "config": "configs/quickstart.yaml",
                "model": {k: v for k, v in cfg.to_dict()["model"].items() if k in ("n_layer", "n_embd", "block_size")},
                "ratio_median": statistics.median(rounds), "ratios": rounds}
    print(f"results: appended to {write_results('dashboard_cost', rows, settings, table='dashboard_cost')}")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
