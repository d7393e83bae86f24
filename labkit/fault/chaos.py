"""A chaos soak: one run, a seeded stream of faults of every kind, and what it should cost, said before it starts.

``fault.chaos_faults: N`` plans N faults (:func:`fault_plan`): the gaps between them drawn from an exponential
distribution of mean ``fault.chaos_every`` steps (faults arrive at random, at a rate), the first of them one of
each kind in ``fault.chaos_kinds`` in a seeded order, then kinds at random; each on a random rank. Every rank
computes the same plan from the config; the injector (:mod:`labkit.fault.inject`) fires the ones that are its
own, each once: a fault recorded in ``faults.jsonl`` does not fire again when a restarted run passes its step
(as a replaced node does not fail again). A ``kill`` comes from outside — :func:`labkit.soak.run_chaos` sends the
SIGKILL when the step rank 0 logged last is the one before it; a ``corrupt_checkpoint`` lands on a checkpoint step.

**Predicted, then checked.** :func:`predicted_soak` adds up what the plan will cost, term by term as Young and
Daly count it — δ per checkpoint saved (replays save again), per fault that ends an attempt a restart R and the
work since the newest valid checkpoint done again (a corrupted newest one: from the one before), a hang's
collective timeout on top, a straggler's extra milliseconds, a NaN's dropped update — from costs measured
before the soak (:class:`SoakCosts`: a clean run's step time and save, a one-crash run's restart). The useful
fraction is the steps whose updates the final model keeps × a clean step's time, over the wall time from the
first step to the last; :func:`measured_soak` reads the same from the soak's events.

**Nothing lost beyond what the design allows**: the final model equals, bit for bit, a clean run told to drop
the same updates (:func:`dropped_updates`: the steps whose last execution was skipped — a NaN's step done again
after a restart is kept, as the replay computed it).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

CHAOS_KINDS = ("crash", "kill", "hang", "straggler", "nan", "corrupt_checkpoint")
ENDS_ATTEMPT = ("crash", "kill", "hang", "corrupt_checkpoint")  # the kinds the elastic agent restarts after
FIRST_FAULT_STEP = 2  # no fault before: the first steps set the baselines the run is judged by


@dataclass(frozen=True)
class Planned:
    """One planned fault: its place in the plan, the step it strikes at, its kind and its rank."""
    index: int
    step: int
    kind: str
    rank: int


def checkpoint_steps(every: int, steps: int) -> list[int]:
    """The steps after which a run with ``fault.checkpoint_every: every`` saves (none after the last step)."""
    return [s for s in range(every - 1, steps - 1, every)] if every > 0 else []


def chaos_kinds(fault) -> tuple[str, ...]:
    """The kinds a soak draws from: ``fault.chaos_kinds``, ``all`` meaning :data:`CHAOS_KINDS`."""
    return CHAOS_KINDS if list(fault.chaos_kinds) == ["all"] else tuple(fault.chaos_kinds)


def fault_plan(fault, world: int, steps: int) -> list[Planned]:
    """Every fault the config plans (``fault`` is the config's fault section): the single ``fault.inject`` one, or
    the seeded chaos stream (:func:`chaos_plan`), or none."""
    if fault.chaos_faults > 0:
        return chaos_plan(fault.chaos_seed, fault.chaos_faults, fault.chaos_every, chaos_kinds(fault), world,
                          steps, fault.checkpoint_every if isinstance(fault.checkpoint_every, int) else 0)
    if fault.inject != "none":
        return [Planned(0, fault.inject_step, fault.inject, fault.inject_rank)]
    return []


def chaos_plan(seed: int, count: int, mean_steps: float, kinds: tuple[str, ...], world: int, steps: int,
               every: int) -> list[Planned]:
    """``count`` faults, gaps exponential of mean ``mean_steps`` (at least one step), each kind in ``kinds`` once
    in a seeded order before any repeats, ranks at random; a corrupted checkpoint on the next checkpoint step after
    the first. A ValueError if they do not fit in ``steps``."""
    rng = random.Random(seed)
    order = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(count - len(kinds))]
    saves, plan, step = checkpoint_steps(every, steps), [], FIRST_FAULT_STEP - 1
    for index, kind in enumerate(order[:count]):
        step += max(1, round(rng.expovariate(1 / mean_steps)))
        if kind == "corrupt_checkpoint":  # never the first save: with none valid before it a run is refused
            step = next((s for s in saves[1:] if s >= step), steps)
        if step >= steps - 1:
            raise ValueError(f"fault.chaos_faults={count} faults every {mean_steps:g} steps on average do not fit in "
                             f"run.steps={steps} (fault {index + 1}, {kind}, would strike at step {step}): raise "
                             f"run.steps or lower fault.chaos_every")
        plan.append(Planned(index, step, kind, rng.randrange(world)))
    return plan


# ---------------------------------------------------------------- the prediction

@dataclass(frozen=True)
class SoakCosts:
    """What the prediction is made from, each measured before the soak: a clean step (s, the median), a checkpoint
    save (s the loop was blocked), a restart (s from the fault to the first step after it, less that step), and
    the config's collective timeout (s, what a hang waits) and straggler delay (s a step)."""
    step_s: float
    save_s: float
    restart_s: float
    timeout_s: float
    straggler_s: float


def replayed(step: int, saves: list[int], corrupted: set[int]) -> tuple[int, int]:
    """(steps done again, checkpoints saved again) after an attempt ends before ``step``: back to the newest save
    before it that is not corrupted."""
    valid = [s for s in saves if s < step and s not in corrupted]
    resume = valid[-1] + 1 if valid else 0
    return step - resume, sum(resume <= s < step for s in saves)


def predicted_soak(plan: list[Planned], steps: int, every: int, costs: SoakCosts, straggler_steps: int) -> dict:
    """The soak's wall time from its first step to its last, term by term, and the useful fraction: the kept
    updates × a clean step over it (the module's docstring)."""
    saves, corrupted = checkpoint_steps(every, steps), set()
    terms = {"steps": steps * costs.step_s, "saves": len(saves) * costs.save_s, "restarts": 0.0, "timeouts": 0.0,
             "replayed": 0.0, "stragglers": 0.0}
    dropped = set()
    for fault in plan:
        if fault.kind in ENDS_ATTEMPT:
            end = fault.step + 1 if fault.kind == "corrupt_checkpoint" else fault.step  # a corrupt one saves first
            if fault.kind == "corrupt_checkpoint":
                corrupted.add(fault.step)
            again, resaved = replayed(end, saves, corrupted)
            terms["restarts"] += costs.restart_s
            terms["replayed"] += again * costs.step_s + resaved * costs.save_s
            terms["timeouts"] += costs.timeout_s if fault.kind == "hang" else 0.0
            dropped -= {s for s in dropped if end - again <= s < end}  # a NaN's step done again is kept
        elif fault.kind == "straggler":
            slow = (straggler_steps or steps) if fault.step < steps else 0
            terms["stragglers"] += min(slow, steps - fault.step) * costs.straggler_s
        elif fault.kind == "nan":
            dropped.add(fault.step)
    wall = sum(terms.values())
    useful = (steps - len(dropped)) * costs.step_s
    return {"terms_s": terms, "wall_s": wall, "useful_s": useful, "useful_fraction": useful / wall,
            "dropped_updates": sorted(dropped)}


def planned_drops(plan: list[Planned], steps: int, every: int) -> list[int]:
    """The updates the plan will skip for good (a NaN's step not done again), which the reference run skips too.
    They depend on where the faults and the saves fall, not on what anything costs: the prediction with unit
    steps and free saves, restarts and waits gives them."""
    return predicted_soak(plan, steps, every, SoakCosts(1.0, 0.0, 0.0, 0.0, 0.0), 0)["dropped_updates"]


# ---------------------------------------------------------------- the measurement

def dropped_updates(events: list[dict]) -> list[int]:
    """The steps whose updates the final model lacks: those whose last execution was skipped."""
    last = {}
    for event in events:
        if event.get("type") == "step":
            last[event["step"]] = bool(event.get("skipped"))
    return sorted(step for step, skipped in last.items() if skipped)


def measured_soak(events: list[dict], steps: int, step_s: float) -> dict:
    """The soak's wall time from its first step's start to its last step's end (the events' clock), and the useful
    fraction as :func:`predicted_soak` counts it: the kept updates × ``step_s`` (a clean step, measured before)."""
    ran = [e for e in events if e.get("type") == "step"]
    wall = ran[-1]["time"] - (ran[0]["time"] - ran[0]["step_time_s"])
    dropped = dropped_updates(events)
    useful = (steps - len(dropped)) * step_s
    return {"wall_s": wall, "useful_s": useful, "useful_fraction": useful / wall, "dropped_updates": dropped,
            "steps_run": len(ran), "restarts": sum(e.get("type") == "resume" and e.get("attempt", 0) > 0
                                                    for e in events)}


def plan_rows(plan: list[Planned]) -> list[dict]:
    return [asdict(f) for f in plan]
