"""Distributed checkpoints that are either whole or ignored: DCP + a manifest + an atomic rename.

A checkpoint is everything a run needs to continue *as if it had never stopped*: model weights,
optimizer state (Adam's moments and step counts), the data loader's position, every rank's RNG
state and the step number. The learning rate is a pure function of the step (labkit.optim.lr_at),
so the step *is* the scheduler's state.

``torch.distributed.checkpoint`` (DCP) writes it: every rank writes its own share in parallel —
a sharded strategy (FSDP2, ZeRO) saves only its shard, nothing is gathered on one rank — and one
``.metadata`` file records which bytes of which tensor live where, so a later run can load it even
with a different sharding.

Two things DCP does not promise, and a crash-safe trainer needs:

1. **Atomicity.** A crash in the middle of a save leaves a half-written directory. So we write to
   ``step_00000100.partial/`` and, once every rank has finished, rank 0 renames it to
   ``step_00000100/``. A rename within one directory is atomic: a reader sees the whole
   checkpoint or none of it.
2. **Integrity.** A disk can truncate or flip bits later. Before the rename rank 0 writes
   ``manifest.json`` with every file's size and SHA-256; on resume a checkpoint is used only if
   every file still matches. A bad one is reported in one line and the previous one is tried.

Only the newest ``keep`` checkpoints are kept. With ``async_save`` the state is first copied to
CPU memory (the only part that blocks training) and written by a background thread through a
separate gloo group, so the training collectives never share a group with the checkpoint's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from labkit.comm import control
from labkit.fault.reshard import (CheckpointMismatch, fit_problems, load_relayout, read_metadata, refusal, relayout,
                                  shards_lost)


def _dcp():
    """``torch.distributed.checkpoint``, imported when a checkpoint is first written or read: it takes
    about 0.7 s, which every process that only reads or checks a config would otherwise pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


MANIFEST = "manifest.json"
PARTIAL = ".partial"
INVALID = ".invalid"  # a checkpoint that failed its check, kept aside when its step is saved again


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> Optional[int]:
    """The step in a finished checkpoint's directory name, or None for anything else."""
    name = path.name
    if not name.startswith("step_") or name.endswith(PARTIAL):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Finished checkpoints (renamed from .partial), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int, extra: Optional[dict] = None) -> dict:
    """Record every file's size and SHA-256 in ``directory/manifest.json`` (written last, fsynced)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"step": step, "files": files, "total_bytes": sum(f["bytes"] for f in files.values()),
                "written_at": time.time(), **(extra or {})}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST)
    return manifest


def verify(directory: str | Path) -> Optional[str]:
    """None if the checkpoint matches its manifest; otherwise one line saying what is wrong."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{directory.name}: no {MANIFEST} (the save never finished)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{directory.name}: unreadable {MANIFEST} ({e})"
    if ".metadata" not in files:
        return f"{directory.name}: {MANIFEST} lists no .metadata file"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{directory.name}: {name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{directory.name}: {name} is {size} bytes, the manifest says {expected['bytes']} (truncated?)"
        if file_digest(path) != expected["sha256"]:
            return f"{directory.name}: {name} does not match its SHA-256 (corrupted)"
    return None


def saved_world_size(directory: str | Path) -> Optional[int]:
    """The world size that wrote a finished checkpoint (its manifest's), or None if not recorded."""
    try:
        return int(json.loads((Path(directory) / MANIFEST).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_valid(directory: str | Path, log: Callable[[str], None] = print) -> Optional[Path]:
    """The newest checkpoint that passes :func:`verify`; each one skipped is logged in one line. None when there is
    no checkpoint; a :class:`~labkit.fault.reshard.CheckpointMismatch` naming each one's problem when there are
    checkpoints and none passes (starting afresh beside them would throw the run's progress away unasked)."""
    problems = []
    for path in list_checkpoints(directory):
        problem = verify(path)
        if problem is None:
            return path
        problems.append(problem)
        log(f"checkpoint skipped: {problem}; trying the previous one")
    if problems:
        raise none_valid(Path(directory), problems)
    return None


def none_valid(directory: Path, problems: list[str]) -> CheckpointMismatch:
    """The error a run stops with when every checkpoint in ``directory`` fails its check."""
    return CheckpointMismatch(
        f"no valid checkpoint to resume from in {directory}: {'; '.join(problems)}. Nothing was loaded and nothing "
        f"there was changed; restore a good copy, or point fault.checkpoint_dir elsewhere to start afresh")


def set_aside(path: Path) -> Path:
    """Keep a checkpoint that is being replaced under another name (``step_00000100.invalid``, then ``.invalid2``…):
    a run resumed past a bad checkpoint saves that step again, and the bad one stays for a person to look at, never
    overwritten. (Not ``step_<number>``, so no resume and no pruning counts it.)"""
    target, n = path.with_name(path.name + INVALID), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{INVALID}{n}")
    path.rename(target)
    return target


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` finished checkpoints; return what was removed."""
    removed = list_checkpoints(directory)[keep:]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def remove_partials(directory: str | Path) -> None:
    """Forget saves that a crash interrupted (never renamed, so never trusted)."""
    directory = Path(directory)
    if directory.is_dir():
        for path in directory.glob(f"*{PARTIAL}"):
            shutil.rmtree(path, ignore_errors=True)


def flip_byte(directory: str | Path, offset_fraction: float = 0.5) -> Path:
    """Corrupt a checkpoint on purpose (fault injection): invert one byte of its largest data file."""
    files = [p for p in Path(directory).iterdir() if p.is_file() and p.name not in (MANIFEST, ".metadata")]
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        f.seek(int(target.stat().st_size * offset_fraction))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target


@dataclass
class SaveRecord:
    step: int
    blocking_s: float  # how long training waited
    path: Path
    total_bytes: Optional[int] = None  # known once finalized
    written_s: Optional[float] = None  # start → every file written (async: the background write's end)
    total_s: Optional[float] = None  # start → sealed (async: sealed at the next save or at the end)


class Checkpointer:
    """Saves and restores a run's state through DCP; every rank calls every method.

    ``save(step, state)`` takes a DCP state dict: nested dicts whose leaves are tensors (DTensors
    for sharded parameters) or small picklable objects. ``restore(make_state)`` builds such a dict
    only if there is a valid checkpoint (building one may create optimizer state), loads into it
    in place and returns ``(path, state)``, or None when there is nothing valid to resume from.
    ``on_finalized(record)`` is called on every rank once a save is sealed.
    """

    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = False,
                 log: Callable[[str], None] = print, on_finalized: Optional[Callable] = None):
        self.directory = Path(directory)
        self.keep, self.async_save, self.log, self.on_finalized = keep, async_save, log, on_finalized
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending: Optional[tuple] = None  # (future, record) of an async save not yet finalized
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_partials(self.directory)
        self._barrier()

    def _barrier(self) -> None:
        if dist.is_initialized():
            control.barrier()

    def save(self, step: int, state: dict) -> SaveRecord:
        """Checkpoint ``state`` as of the end of ``step``; returns how long training was blocked.

        A pending async save is finished first, so at most one is in flight."""
        self.wait()
        start = time.perf_counter()
        partial = self.directory / (checkpoint_name(step) + PARTIAL)
        record = SaveRecord(step, 0.0, self.directory / checkpoint_name(step))
        if self.async_save:
            future = _dcp().async_save(state, checkpoint_id=partial, process_group=self.group)
            record.blocking_s = time.perf_counter() - start
            written = getattr(future, "upload_completion", future)
            written.add_done_callback(lambda _: setattr(record, "written_s", time.perf_counter() - start))
            self.pending = (future, record, start)
        else:
            _dcp().save(state, checkpoint_id=partial)
            record.blocking_s = record.written_s = time.perf_counter() - start
            self._finalize(record, start)
        return record

    def wait(self) -> Optional[SaveRecord]:
        """Finish the async save in flight, if any (its files, manifest and rename)."""
        if self.pending is None:
            return None
        future, record, start = self.pending
        self.pending = None
        result = getattr(future, "upload_completion", future)  # AsyncSaveResponse or a plain Future
        result.result()
        record.written_s = record.written_s or time.perf_counter() - start
        self._finalize(record, start)
        return record

    def _finalize(self, record: SaveRecord, start: float) -> None:
        """Every rank's files are written (DCP's coordinator wrote .metadata last): seal and rename."""
        self._barrier()
        if self.rank == 0:
            partial = record.path.with_name(record.path.name + PARTIAL)
            manifest = write_manifest(partial, record.step, {"world_size": dist.get_world_size()
                                                             if dist.is_initialized() else 1})
            if record.path.exists():  # a save of the same step by an earlier attempt: one that failed its check
                set_aside(record.path)
            partial.rename(record.path)
            prune(self.directory, self.keep)
            record.total_bytes = manifest["total_bytes"]
        record.total_s = time.perf_counter() - start
        self._barrier()
        if self.on_finalized:
            self.on_finalized(record)

    def restore(self, make_state: Callable[[], dict]) -> Optional[tuple[Path, dict]]:
        """Load the newest valid checkpoint into ``make_state()``; all ranks agree on which."""
        choice = None
        if self.rank == 0:
            try:
                path = newest_valid(self.directory, self.log)
                choice = None if path is None else str(path)
            except CheckpointMismatch as refused:
                choice = refused
        if dist.is_initialized():
            choice = control.broadcast_object(choice, src=0)
        if isinstance(choice, CheckpointMismatch):
            raise choice  # on every rank, before anything is loaded
        if choice is None:
            return None
        state, path = make_state(), Path(choice)
        plan = self.load_plan(path, state)
        if plan is None:  # every entry checked: only a rank's own share a new rank lacks may be missing
            from torch.distributed.checkpoint import DefaultLoadPlanner

            _dcp().load(state, checkpoint_id=choice, planner=DefaultLoadPlanner(allow_partial_load=True))
        else:
            state = load_relayout(path, state, plan, read_metadata(path))
        return path, state

    def load_plan(self, path: Path, state: dict) -> Optional[dict]:
        """None when the checkpoint fits ``state`` as it is; a plan to load it from another layout (pipeline stages,
        q/k/v split by DTensor tensor parallelism: :func:`labkit.fault.reshard.relayout_plan`) when any rank needs
        one; or a refusal, every rank with the same error naming each problem any rank found, before anything is
        loaded."""
        problems = self._everyones(fit_problems(path, state))
        if not problems:
            return None
        plan, left = relayout(path, state) if not shards_lost(problems) else (None, problems)
        left = self._everyones(left)
        if left:
            raise refusal(path, left, saved_world_size(path), dist.get_world_size() if dist.is_initialized() else 1)
        return plan

    @staticmethod
    def _everyones(problems: list[str]) -> list[str]:
        """Every rank's problems, each once, on every rank (a collective)."""
        if not dist.is_initialized():
            return problems
        return list(dict.fromkeys(p for found in control.all_gather_objects(problems) for p in found))

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
