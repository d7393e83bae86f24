"""The chaos soak as an experiment: measure the costs, predict, run the soak, check it (the test and
``benchmarks/chaos_soak.py`` both run :func:`soak_experiment`). The plan, the prediction and the measurement are
:mod:`labkit.fault.chaos`'s; launching runs and killing ranks from outside is here, above the launcher.

1. **The reference**: the soak's config without its faults, told to drop the updates the plan's NaNs will cost
   (:func:`labkit.fault.chaos.predicted_soak`'s ``dropped_updates``). Its wall time per step gives a clean step's
   time (:func:`clean_costs`), its saves what a checkpoint blocks, its final model what the soak must end with, bit
   for bit.
2. **The restart probe**: the same config with :data:`PROBE_CRASHES` crashes; the median of their recoveries
   (fault → first step after the resume, less that step) is what a restart costs.
3. **The prediction**, from those costs and the plan, written down before the soak starts.
4. **The soak** (:func:`run_chaos`), then what it measured: its wall time and useful
   fraction, every fault's detection and recovery, and the final model against the reference.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from labkit.fault.chaos import (Planned, SoakCosts, fault_plan, measured_soak, plan_rows, planned_drops,
                                predicted_soak)

PROBE_CRASHES = 3  # restarts the probe times (their median is the prediction's R: one alone varies by a second)
UNSEEN = "none: a {kind} ends no attempt"


def without_faults(cfg, **overrides):
    return cfg.replace(**{"fault.chaos_faults": 0, "fault.inject": "none", "fault.max_restarts": 0, **overrides})


def finished(run, timeout_s: float):
    status = run.wait(timeout=timeout_s)
    if status != "finished":
        raise RuntimeError(f"{run.run_dir.name}: {status}\n{run.log()[-3000:]}")
    return run


def all_events(run) -> list[dict]:
    """Every line of the run's ``events.jsonl`` (``Run.events`` thins a long run's older steps)."""
    from labkit.metrics.events import read_events

    return read_events(Path(run.run_dir) / "events.jsonl")[0]


def step_events(run) -> list[dict]:
    return [e for e in all_events(run) if e.get("type") == "step"]


def clean_costs(run) -> tuple[float, float]:
    """(a clean step's seconds, a save's blocking seconds), from the reference. A step as the loop pays for it: the
    wall time from the first step's start to the last step's end, less the saves, over the steps — its own
    ``step_time_s`` and everything between two steps (the events written, the callbacks), which ``step_time_s``
    leaves out. A save: the median of what each blocked the loop."""
    steps = step_events(run)
    saves = [e["blocking_s"] for e in all_events(run) if e.get("type") == "checkpoint"]
    wall = steps[-1]["time"] - (steps[0]["time"] - steps[0]["step_time_s"])
    return (wall - sum(saves)) / len(steps), statistics.median(saves) if saves else 0.0


def restart_cost(cfg, nproc: int, root: Path, step_s: float, timeout_s: float) -> tuple[float, list[float]]:
    """A restart's seconds: a run with :data:`PROBE_CRASHES` crashes (a chaos plan of crashes only, a checkpoint
    interval apart on average), each fault → first step after the resume, less that step; their median, and each."""
    from labkit.fault.recovery import recovery_report
    from labkit.launcher import launch

    every = cfg.fault.checkpoint_every
    probe = without_faults(cfg, **{"fault.chaos_faults": PROBE_CRASHES, "fault.chaos_kinds": ["crash"],
                                   "fault.chaos_every": 2 * every, "fault.chaos_seed": 0,
                                   "fault.max_restarts": PROBE_CRASHES, "run.steps": every * (2 * PROBE_CRASHES + 4)})
    run = finished(launch(probe, nproc=nproc, run_dir=root / "restart-probe"), timeout_s)
    each = [fault["recovery_s"] - step_s for fault in recovery_report(run.run_dir)]
    return statistics.median(each), each


def soak_experiment(cfg, nproc: int, root: Path, timeout_s: float = 900.0,
                    say: Callable[[str], None] = print) -> dict:
    """Measure, predict, soak, check (the module's docstring). Returns the record: the plan, the costs, the
    prediction, the measurement, every fault's report, whether the final model equals the reference's."""
    import torch

    from labkit.fault.recovery import recovery_report, same_parameters
    from labkit.launcher import launch

    root.mkdir(parents=True, exist_ok=True)
    steps, every = cfg.run.steps, cfg.fault.checkpoint_every
    plan = fault_plan(cfg.fault, nproc, steps)
    dropped = planned_drops(plan, steps, every)
    say(f"chaos soak: {len(plan)} faults planned over {steps} steps on {nproc} processes: "
        + ", ".join(f"{f.kind}@{f.step}/r{f.rank}" for f in plan))
    reference = finished(launch(without_faults(cfg, **{"fault.skip_steps": dropped}), nproc=nproc,
                                run_dir=root / "reference"), timeout_s)
    step_s, save_s = clean_costs(reference)
    restart_s, restarts = restart_cost(cfg, nproc, root, step_s, timeout_s)
    costs = SoakCosts(step_s, save_s, restart_s, cfg.comm.timeout_s, cfg.fault.straggler_ms / 1000)
    prediction = predicted_soak(plan, steps, every, costs, cfg.fault.straggler_steps)
    (root / "prediction.json").write_text(json.dumps({"costs": asdict(costs), **prediction}, indent=1))
    say(f"predicted before the soak: useful fraction {prediction['useful_fraction']:.3f} of "
        f"{prediction['wall_s']:.1f} s (step {step_s * 1e3:.1f} ms, save {save_s * 1e3:.1f} ms, restart "
        f"{restart_s:.2f} s)")
    began = time.monotonic()
    soak = run_chaos(cfg, nproc, run_dir=root / "soak", timeout_s=timeout_s)
    soak_s = time.monotonic() - began
    measured = measured_soak(all_events(soak), steps, step_s)
    equal, verdict = same_parameters(*(torch.load(r.run_dir / "final_model.pt", weights_only=True)
                                       for r in (soak, reference)))
    faults = recovery_report(soak.run_dir)
    say(f"measured: useful fraction {measured['useful_fraction']:.3f} of {measured['wall_s']:.1f} s "
        f"({soak_s:.0f} s with start-up), {len(faults)} faults on record; final model vs reference: {verdict}")
    return {"plan": plan_rows(plan), "costs": asdict(costs), "probe_restarts_s": restarts,
            "predicted": prediction, "measured": measured,
            "faults": faults, "soak_s": soak_s, "bitwise_equal": equal, "equality": verdict,
            "points_apart": 100 * abs(measured["useful_fraction"] - prediction["useful_fraction"]),
            "summary": soak.summary, "run_dir": str(soak.run_dir)}


def fault_table(record: dict) -> list[dict]:
    """A row per planned fault: its kind, step and rank, and when it was seen and recovered (None where it ends
    no attempt: a NaN's dropped update and a straggler's slow steps are in the step events)."""
    by_index = {f["planned"]: f for f in record["faults"] if f.get("planned") is not None}
    rows = []
    for planned in record["plan"]:
        seen: Optional[dict] = by_index.get(planned["index"])
        rows.append({**planned, "on_record": seen is not None,
                     "detected_s": seen and seen["detected_s"], "recovery_s": seen and seen["recovery_s"],
                     "steps_recomputed": seen and seen["steps_recomputed"]})
    return rows


def run_chaos(cfg, nproc: int, run_dir=None, timeout_s: float = 900.0, poll_s: float = 0.02):
    """Launch the run and play its plan's ``kill`` faults from outside: each SIGKILLs its rank once the step rank 0
    logged last is the one before it (the last, not the furthest: an attempt that replays steps after a restart
    gets there again; the other kinds fire inside the workers). Returns the finished
    :class:`labkit.launcher.Run`; a run that does not finish in ``timeout_s`` is stopped and a TimeoutError
    raised (its run directory kept)."""
    from labkit.launcher import launch
    from labkit.metrics.events import read_events

    plan = fault_plan(cfg.fault, nproc, cfg.run.steps)
    kills = [f for f in plan if f.kind == "kill"]
    run = launch(cfg, nproc=nproc, run_dir=run_dir)
    deadline, offset, done = time.monotonic() + timeout_s, 0, -1
    while run.status == "running" and time.monotonic() < deadline:
        if kills:  # the new lines only: parsing the whole file every poll would take the workers' cores
            events, offset = read_events(Path(run.run_dir) / "events.jsonl", offset)
            done = next((e["step"] for e in reversed(events) if e.get("type") == "step"), done)
            if done >= kills[0].step - 1 and _kill(run, kills[0]) is not None:
                kills.pop(0)
                continue
        time.sleep(poll_s)
    if run.status == "running":
        run.stop()
        raise TimeoutError(f"the chaos soak did not finish in {timeout_s:.0f} s; its events are in {run.run_dir}")
    return run


def _kill(run, fault: Planned) -> Optional[int]:
    """SIGKILL the fault's rank (recorded in faults.jsonl with its place in the plan); None if no worker of it is
    live at that moment (between attempts: the caller tries again at its next poll)."""
    from labkit.launcher import kill_rank

    try:
        return kill_rank(run.run_dir, fault.rank, planned=fault.index)
    except (ValueError, ProcessLookupError):
        return None
