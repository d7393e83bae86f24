"""The ``fault`` section's config checks (restarts, checkpoints, injected faults), run by
``labkit.validation.validate`` before any worker starts. This module imports neither torch nor labkit.config."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def fault_problems(f, world: int) -> list[str]:
    """The ``fault`` section: restarts, checkpoints and deliberate faults, said before any worker starts."""
    problems = []
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
    if f.straggler_ms < 0:
        problems.append(f"fault.straggler_ms: must be >= 0, got {f.straggler_ms}")
    if f.checkpoint_dir is not None:
        problem = unwritable(f.checkpoint_dir)
        if problem:
            problems.append(f"fault.checkpoint_dir: {problem}")
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
