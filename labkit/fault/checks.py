"""The ``fault`` section's config checks (restarts, checkpoints, injected faults), run by
``labkit.validation.validate`` before any worker starts. This module imports neither torch nor labkit.config."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from labkit.fault.chaos import CHAOS_KINDS, ENDS_ATTEMPT, chaos_kinds, chaos_plan  # no torch there either


def fault_problems(f, world: int, steps: int = 0, collective_timeout_s: float = 300.0) -> list[str]:
    """The ``fault`` section: restarts, checkpoints, deliberate faults, a chaos soak's plan and the timeout ladder,
    said before any worker starts."""
    problems = timeout_ladder_problems(f, collective_timeout_s) + chaos_problems(f, world, steps)
    if f.max_restarts < 0:
        problems.append(f"fault.max_restarts: must be >= 0 (restarts allowed after a failure), got {f.max_restarts}")
    if f.checkpoint_every != "auto" and f.checkpoint_every < 0:
        problems.append(f"fault.checkpoint_every: must be >= 0 steps (0 disables checkpoints) or auto, "
                        f"got {f.checkpoint_every}")
    if f.checkpoint_every == "auto" and not f.mtbf_s > 0:
        problems.append(f"fault.mtbf_s: checkpoint_every=auto plans for a mean time between failures > 0 seconds, "
                        f"got {f.mtbf_s}")
    if f.keep_last < 1:
        problems.append(f"fault.keep_last: must be >= 1 checkpoint, got {f.keep_last}")
    if f.inject != "none":
        if not 0 <= f.inject_rank < world:
            problems.append(f"fault.inject_rank={f.inject_rank} does not exist: ranks are 0..{world - 1} "
                            f"(world size {world})")
        if f.inject_step < 0:
            problems.append(f"fault.inject_step: must be >= 0, got {f.inject_step}")
    if f.inject == "corrupt_checkpoint" and f.checkpoint_every == 0:
        problems.append("fault.inject=corrupt_checkpoint needs checkpoints: set fault.checkpoint_every > 0")
    elif f.inject == "corrupt_checkpoint":
        problems += corrupt_problems(f)
    if f.straggler_ms < 0:
        problems.append(f"fault.straggler_ms: must be >= 0, got {f.straggler_ms}")
    if f.checkpoint_dir is not None:
        problem = unwritable(f.checkpoint_dir)
        if problem:
            problems.append(f"fault.checkpoint_dir: {problem}")
    return problems


def timeout_ladder_problems(f, collective_timeout_s: float) -> list[str]:
    """comm.timeout_s < fault.watchdog_s < fault.rendezvous_timeout_s: a hung collective is reported by its own
    error (naming the operation) before the watchdog ends the attempt, and the watchdog ends a stuck rank before
    the others give up waiting for the group to re-form — otherwise a fault the run could survive ends it."""
    ladder = [("comm.timeout_s", collective_timeout_s)] + [("fault.watchdog_s", f.watchdog_s)] * (
        f.watchdog_s is not None) + [("fault.rendezvous_timeout_s", f.rendezvous_timeout_s)]
    problems = [f"{name}: must be > 0 seconds, got {value}" for name, value in ladder if not value > 0]
    if problems:
        return problems
    broken = [(a, b) for a, b in zip(ladder, ladder[1:]) if not a[1] < b[1]]
    if broken:
        said = " < ".join(f"{name} ({value:g} s)" for name, value in ladder)
        problems.append(f"the timeout ladder must hold: {said}; "
                        + "; ".join(f"{a} is not below {b}" for (a, _), (b, _) in broken)
                        + " (a collective reports its own hang first, the watchdog ends a stuck rank next, and the "
                          "group waits longer than both to re-form)")
    return problems


def chaos_problems(f, world: int, steps: int) -> list[str]:
    """A chaos soak's settings, and whether its plan fits the run (labkit.fault.chaos.chaos_plan)."""
    if f.chaos_faults == 0:
        return []
    problems = []
    if f.chaos_faults < 0:
        return [f"fault.chaos_faults: must be >= 0 faults (0: no soak), got {f.chaos_faults}"]
    if f.inject != "none":
        problems.append(f"fault.inject={f.inject} and fault.chaos_faults={f.chaos_faults}: choose one (a chaos soak "
                        "plans every fault itself)")
    unknown = [k for k in f.chaos_kinds if k not in CHAOS_KINDS] if list(f.chaos_kinds) != ["all"] else []
    if unknown or not f.chaos_kinds:
        problems.append(f"fault.chaos_kinds: {unknown or 'none given'}; choose from {', '.join(CHAOS_KINDS)}, "
                        "or all")
    if not f.chaos_every >= 1:
        problems.append(f"fault.chaos_every: the mean steps between faults must be >= 1, got {f.chaos_every}")
    if not isinstance(f.checkpoint_every, int) or f.checkpoint_every <= 0:
        problems.append(f"fault.chaos_faults needs checkpoints every fixed number of steps to recover from: set "
                        f"fault.checkpoint_every > 0 (got {f.checkpoint_every})")
    elif "corrupt_checkpoint" in chaos_kinds(f) and f.keep_last < 2:
        problems.append("fault.chaos_kinds has corrupt_checkpoint: keep fault.keep_last >= 2 checkpoints, or there "
                        "is none left to resume from")
    if problems:
        return problems
    try:
        plan = chaos_plan(f.chaos_seed, f.chaos_faults, f.chaos_every, chaos_kinds(f), world, steps,
                          f.checkpoint_every)
    except ValueError as error:
        return [str(error)]
    restarts = sum(p.kind in ENDS_ATTEMPT for p in plan)
    if f.max_restarts < restarts:
        problems.append(f"fault.max_restarts={f.max_restarts}: the chaos plan ends {restarts} attempts (crash, kill, "
                        f"hang, corrupt checkpoint); allow at least {restarts} restarts")
    return problems


def unwritable(directory: str) -> Optional[str]:
    """Why files could not be written in ``directory``, or None if they can (tried for real: the
    directory is created, as the run would, and a probe file written and removed)."""
    path = Path(directory).expanduser().absolute()
    probe = path / f".labkit-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return f"cannot write in {path} ({error.strerror or error}); choose a directory you can write to"
    return None


def corrupt_problems(f) -> list[str]:
    """A corrupted checkpoint is recovered from the one before it: there must be one (saved, and kept). With
    ``checkpoint_every: auto`` the saves are not known before the run; the resume refuses then, naming the file."""
    problems = []
    if f.keep_last < 2:
        problems.append(f"fault.inject=corrupt_checkpoint: keep fault.keep_last >= 2 checkpoints (got {f.keep_last}), "
                        "or none is left to resume from")
    if isinstance(f.checkpoint_every, int) and f.checkpoint_every > 0:
        saved = len(range(f.checkpoint_every - 1, f.inject_step + 1, f.checkpoint_every))
        if saved < 2:
            problems.append(f"fault.inject=corrupt_checkpoint at fault.inject_step={f.inject_step} finds "
                            f"{saved} checkpoint(s) saved (every {f.checkpoint_every} steps): the one corrupted needs "
                            f"a valid one before it; inject at step >= {2 * f.checkpoint_every - 1}")
    return problems
