"""Recovery: what a run saves to continue bit for bit, how long recovering took, how often to save.

**The state of a run** is more than its weights. To continue *exactly* as if nothing happened, a
restarted worker needs the optimizer's moments and step counts, the data loader's position (or it
would see some batches twice and skip others), each rank's random-number generator, the loss
scaler's scale (fp16), a gradient compressor's error memory and warm starts (each rank's own: the
gradient it still owes the model) and the step itself. :func:`training_state` collects them as one
DCP state dict; :func:`restore_training_state` puts a loaded one back.

**Recovery time** is measured from the fault's own record (``faults.jsonl``, written before the
fault happens) to the first training step after the resume — detection, restart, rendezvous,
loading and the first step all included. **Lost work** is the steps done twice: those between
the checkpoint that was loaded and the fault.

**How often to checkpoint.** Saving costs δ seconds each time; a failure costs, on average, half
an interval of lost work. With mean time between failures M, the expected overhead per unit of
time is δ/τ + τ/(2M), smallest at Young's interval τ* = √(2δM) (Young 1974; Daly 2006 refines it
for δ not ≪ M). Saving more often than τ* wastes time saving; less often, recomputing.
"""
from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Optional

import torch

from labkit.metrics.events import read_events


def training_state(trainer, step: int) -> dict:
    """Everything needed to continue after ``step`` as a DCP state dict (tensors are references:
    ``dcp.load`` fills them in place)."""
    env = trainer.env
    state = trainer.strategy.checkpoint_state(trainer.model, trainer.optimizer)
    part = model_part_key(trainer.cfg, env.grid)
    if part:
        state = {part: state}
    rng = {"cpu": torch.get_rng_state()}
    if env.device == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.local_rank)
    state.update(step=step, loader=trainer.loader.state_dict(), rng={f"rank{env.rank}": rng})
    if trainer.precision.scaler is not None:
        state["scaler"] = trainer.precision.scaler.state_dict()
    compressor = trainer.strategy.compressor
    if compressor is not None:  # each rank's error memory differs: one opaque share per rank
        state["compressor"] = {f"rank{env.rank}": to_bytes(compressor.state_dict())}
    return state


def model_part_key(cfg, grid) -> str | None:
    """The key this rank's part of a split model is saved under, or None for a whole model.

    DCP names each tensor by its parameter's path and takes plain tensors saved under one name by
    several ranks for copies of one tensor: it writes one. labkit's tensor-parallel slices and the
    pipeline's stages are different tensors on different ranks, so each part is saved under its own
    coordinates (its dp replicas share it). DTensor's slices know their place in the whole tensor,
    so torch's tensor parallelism needs no key of its own. Under expert parallelism each ep rank's experts (and
    their optimizer state) are others: each ep coordinate saves its part, the dense parameters with it.
    """
    pp, tp = grid.size("pp"), grid.size("tp")
    parts = [f"pp{grid.coord('pp')}"] if pp > 1 else []
    if tp > 1 and cfg.parallel.tp.impl == "labkit":
        parts.append(f"tp{grid.coord('tp')}")
    if grid.size("ep") > 1:
        parts.append(f"ep{grid.coord('ep')}")
    return "_".join(parts) or None


def to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    """:func:`to_bytes` undone, for plain data only: tensors, numbers, strings, lists, tuples, dicts.

    A checkpoint is data read from a run directory, never code to run: ``weights_only=True`` refuses
    any pickled object that would call something while loading.
    """
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as refused:
        raise ValueError("refusing to load a checkpoint share that is not plain tensors and numbers "
                         f"(it could run code): {str(refused).splitlines()[0]}") from refused


def restore_training_state(trainer, state: dict) -> int:
    """Put a loaded :func:`training_state` back; returns the next step to run."""
    env = trainer.env
    part = model_part_key(trainer.cfg, env.grid)
    trainer.strategy.load_checkpoint_state(trainer.model, trainer.optimizer, state[part] if part else state)
    trainer.loader.load_state_dict(state["loader"])
    rng = state["rng"][f"rank{env.rank}"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], env.local_rank)
    if "scaler" in state:
        trainer.precision.scaler.load_state_dict(state["scaler"])
    if "compressor" in state:
        trainer.strategy.compressor.load_state_dict(from_bytes(state["compressor"][f"rank{env.rank}"]))
    return int(state["step"]) + 1


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that minimises expected overhead: √(2·δ·M)."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint cost and MTBF must be > 0 seconds, got δ={checkpoint_s}, M={mtbf_s}")
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_overhead(interval_s: float, checkpoint_s: float, mtbf_s: float) -> dict:
    """Fractions of wall time spent saving (δ/τ) and recomputing lost work (τ/2M), and their sum."""
    if interval_s <= 0:
        raise ValueError(f"checkpoint interval must be > 0 seconds, got {interval_s}")
    saving, lost = checkpoint_s / interval_s, interval_s / (2 * mtbf_s)
    return {"saving": saving, "lost_work": lost, "total": saving + lost}


def recovery_report(run_dir: str | Path) -> list[dict]:
    """For each recorded fault: when it happened, where the run resumed and how long that took.

    Reads ``faults.jsonl`` and ``events.jsonl`` (see :func:`match_recoveries`).
    """
    run_dir = Path(run_dir)
    faults, _ = read_events(run_dir / "faults.jsonl")
    events, _ = read_events(run_dir / "events.jsonl")
    return match_recoveries(faults, events)


KEEPS_ATTEMPT = ("nan", "straggler")  # faults the run lives through without a restart: no resume of theirs


def match_recoveries(faults: list[dict], events: list[dict]) -> list[dict]:
    """Each fault record matched with the resume that followed it, in time order (a live run's so far).

    ``recovery_s`` is fault → first step event after that resume (None if the run has not resumed yet,
    or needed no restart). ``detected_s`` is fault → the first ``detected`` record after it (a rank that saw the
    attempt fail: :func:`labkit.fault.inject.record_detection`), None if none did before the resume.
    ``step`` is the step the fault stopped: the recorded one, or later if steps were
    still logged between the record and the resume (a kill from outside records the last step it saw, and
    the signal lands a moment later).
    """
    report = []
    detections = sorted(r["time"] for r in faults if r.get("type") == "detected")
    for fault in sorted((r for r in faults if r.get("type", "fault") == "fault"), key=lambda f: f["time"]):
        resume = None if fault["kind"] in KEEPS_ATTEMPT else next(
            (e for e in events if e["type"] == "resume" and e["time"] > fault["time"]), None)
        seen = None if fault["kind"] in KEEPS_ATTEMPT else next(
            (t for t in detections if t > fault["time"] and (resume is None or t < resume["time"])), None)
        entry = {"kind": fault["kind"], "rank": fault.get("rank"), "step": fault.get("step"),
                 "planned": fault.get("planned"), "time": fault["time"], "resumed_at_step": None,
                 "steps_recomputed": None, "recovery_s": None,
                 "detected_s": None if seen is None else seen - fault["time"]}
        if resume is not None:
            first = next((e for e in events if e["type"] == "step" and e["time"] > resume["time"]), None)
            logged = [e["step"] for e in events if e["type"] == "step" and fault["time"] < e["time"] < resume["time"]]
            if logged and fault.get("step") is not None:
                entry["step"] = max(fault["step"], logged[-1] + 1)
            entry["resumed_at_step"] = resume["next_step"]
            if entry["step"] is not None:
                entry["steps_recomputed"] = max(0, entry["step"] - resume["next_step"])
            if first is not None:
                entry["recovery_s"] = first["time"] - fault["time"]
        report.append(entry)
    return report


def last_step_seen(run_dir: str | Path) -> Optional[int]:
    """The last step rank 0 reported (for faults recorded from outside, like a kill)."""
    events, _ = read_events(Path(run_dir) / "events.jsonl")
    steps = [e["step"] for e in events if e["type"] == "step"]
    return steps[-1] if steps else None


# ---------------------------------------------------------------- a run's recovery, from its events

def attempts(events: list[dict]) -> list[list[dict]]:
    """Step events split by restart attempt (a resume starts a new attempt)."""
    out: list[list[dict]] = [[]]
    for e in events:
        if e.get("type") == "resume" and out[-1]:
            out.append([])
        elif e.get("type") == "step":
            out[-1].append(e)
    return [a for a in out if a]


def measured_checkpoint_cost(events: list[dict]) -> Optional[float]:
    """Median seconds training was blocked per checkpoint in a run (None if it saved none)."""
    costs = sorted(e["blocking_s"] for e in events if e.get("type") == "checkpoint")
    return costs[len(costs) // 2] if costs else None


def seconds_between_checkpoints(events: list[dict]) -> Optional[float]:
    """Mean wall-clock seconds between a run's checkpoints (None if it saved fewer than two)."""
    saves = [e for e in events if e.get("type") == "checkpoint"]
    if len(saves) < 2:
        return None
    return (saves[-1]["time"] - saves[0]["time"]) / (len(saves) - 1)


def same_parameters(a: dict, b: dict) -> tuple[bool, str]:
    """Bit-for-bit comparison of two state dicts, with a one-line verdict."""
    if a.keys() != b.keys():
        return False, f"different parameter names: {sorted(set(a) ^ set(b))[:4]}"
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    count = sum(t.numel() for t in a.values())
    if differing:
        worst = max(float((a[k] - b[k]).abs().max()) for k in differing)
        return False, f"{len(differing)} of {len(a)} tensors differ (largest difference {worst:.3g})"
    return True, f"all {len(a)} tensors ({count:,} numbers) are bit-for-bit identical"
