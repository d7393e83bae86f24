"""torch.compile, verified by measurement.

A compiler fuses operations and generates kernels for *this* model on *this* hardware — usually
faster, but not always: the source text reports a compiler making one GPU 18% slower, and on small
CPU models the compiled step is often no faster. So labkit's ``run.compile: verify`` measures
instead of assuming: a few eager steps, then the same number of compiled steps (after the one
that pays for compilation), and it keeps whichever was faster — recording both numbers.

Compilation happens in place (``nn.Module.compile``), so the strategy's wrapper (DDP, FSDP2)
keeps the same module object; going back to eager just drops the compiled call. ``run.compile: on``
compiles as the model is built, after the split and before the data-parallel wrap
(:func:`labkit.parallel.parallelize.apply_compile`, which says why); ``verify`` compiles mid-run, after
its eager steps (the ``CompileCheck`` callback).
"""
from __future__ import annotations

import statistics
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import control

WARMUP, TIMED = 1, 3
VERIFY_STEPS = WARMUP + TIMED + 1 + TIMED  # eager warm-up, eager timed, compile, compiled timed


def compile_in_place(model: nn.Module) -> None:
    model.compile()


def back_to_eager(model: nn.Module) -> None:
    model._compiled_call_impl = None


class CompileVerifier:
    """Feeds on step times; after ``VERIFY_STEPS`` steps returns its decision, identical on every rank."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.eager: list[float] = []
        self.compiled: list[float] = []
        self.compile_s: Optional[float] = None

    def record(self, step: int, step_time_s: float) -> Optional[dict]:
        if WARMUP <= step < WARMUP + TIMED:
            self.eager.append(step_time_s)
            if step == WARMUP + TIMED - 1:
                compile_in_place(self.model)
        elif step == WARMUP + TIMED:
            self.compile_s = step_time_s  # this step paid for compilation
        elif step < VERIFY_STEPS:
            self.compiled.append(step_time_s)
            if step == VERIFY_STEPS - 1:
                return self.decide()
        return None

    def decide(self) -> dict:
        times = torch.tensor([statistics.mean(self.eager), statistics.mean(self.compiled)], dtype=torch.float64)
        if dist.is_initialized():
            control.max_over_ranks(times)  # the slowest rank decides, the same everywhere
        eager_s, compiled_s = times.tolist()
        kept = "compiled" if compiled_s < eager_s else "eager"
        if kept == "eager":
            back_to_eager(self.model)
        return {"eager_step_s": eager_s, "compiled_step_s": compiled_s, "compile_s": self.compile_s,
                "speedup": eager_s / compiled_s, "kept": kept}


def compile_problems(run_cfg) -> list[str]:
    """``run.compile=verify`` needs enough steps to time both versions."""
    if run_cfg.compile == "verify" and run_cfg.steps < VERIFY_STEPS:
        return [f"run.compile=verify measures {VERIFY_STEPS} steps (eager, then compiled); "
                f"run.steps={run_cfg.steps} is fewer: raise run.steps or use run.compile=on/off"]
    return []
