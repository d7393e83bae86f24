"""Resharding: a checkpoint saved at one world size (or layout) resumed at another, or refused with a reason.

DCP's ``.metadata`` names every tensor of a checkpoint with its *whole* shape and, for each piece a rank wrote,
where in the whole tensor it sits and which file holds it. Loading asks for pieces of the whole tensors, whatever
cut the reader uses: a DTensor (FSDP2, DTensor tensor parallelism, ZeRO's flat optimizer slices:
``labkit.parallel.dp.zero_optimizer``) asks for its own slice, a replicated tensor (DDP) for all of it. So a run
saved by 4 ranks resumes on 2 or 3 as long as every tensor is named by what it *is*, never by the rank that held
it (the parts keyed by a rank — local SGD's replicas, labkit's own tensor-parallel slices — cannot be).

What this module adds around ``dcp.load``:

* :func:`fit_problems` — before anything is loaded, the checkpoint is compared with the state the run would load
  into: a tensor it lacks, another shape or dtype (another model), a piece whose file is gone or a tensor whose
  pieces do not cover it (missing shards). Each problem is one line naming the tensor; the run is refused with them
  (:class:`CheckpointMismatch`) and nothing in its directory is touched.
* :func:`gathered` — every tensor of a checkpoint whole, read by one process without a process group: what tests
  compare bit for bit between a checkpoint saved at world 4 and the same state saved again at world 2.

The data loader's position is three integers of the *global* sample stream (``labkit.data.loader``): with the
global batch fixed, the new world reads exactly the samples the old one would have read next, each rank a
different share of them (more gradient accumulation per rank on fewer ranks).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import torch

MAX_LISTED = 6  # problems named in a refusal; the rest are counted


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the run that would load it (its message names every problem)."""


def read_metadata(path: str | Path):
    """DCP's ``.metadata`` of the checkpoint at ``path`` (tensor shapes, pieces, the files holding them)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def flat_state(state: dict) -> dict:
    """``state`` flattened as DCP names its entries (``model.blocks.0.attn.weight``, ``optim.state....``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def fit_problems(path: str | Path, state: dict) -> list[str]:
    """Why the checkpoint at ``path`` cannot be loaded into ``state`` (this rank's DCP state dict); [] if it can."""
    try:
        metadata = read_metadata(path)
    except Exception as error:  # a missing or unreadable .metadata: no checkpoint to speak of
        return [f".metadata cannot be read ({type(error).__name__}: {error})"]
    saved = metadata.state_dict_metadata
    problems = [problem for key, value in flat_state(state).items()
                if (problem := entry_problem(key, value, saved.get(key)))]
    return problems + shard_problems(Path(path), metadata)


def entry_problem(key: str, value, saved) -> str | None:
    """What is wrong with one entry of the checkpoint (``saved``, its metadata) for ``value``; None if nothing."""
    if saved is None:
        return f"{key} is not in the checkpoint"
    if not torch.is_tensor(value):
        return None
    size = getattr(saved, "size", None)
    if size is None:
        return f"{key} is a tensor here but not in the checkpoint"
    if tuple(size) != tuple(value.shape):
        return f"{key} has shape {list(size)} in the checkpoint, {list(value.shape)} here"
    if saved.properties.dtype != value.dtype:
        return f"{key} is {saved.properties.dtype} in the checkpoint, {value.dtype} here"
    return None


def shard_problems(directory: Path, metadata) -> list[str]:
    """Pieces whose file is missing or too short, and tensors whose saved pieces do not cover them whole."""
    problems, files = [], {}
    for index, info in metadata.storage_data.items():
        files.setdefault(info.relative_path, []).append((index.fqn, info.offset + info.length))
    for name, pieces in sorted(files.items()):
        size = (directory / name).stat().st_size if (directory / name).is_file() else None
        names = sorted({fqn for fqn, _ in pieces})
        held = f"it held {len(pieces)} pieces: {', '.join(names[:3])}{', …' if len(names) > 3 else ''}"
        if size is None:
            problems.append(f"shard file {name} is missing ({held})")
        elif size < max(end for _, end in pieces):
            problems.append(f"shard file {name} is {size} bytes, shorter than the pieces it holds ({held})")
    for key, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is not None and sum(math.prod(c.sizes) for c in chunks) != math.prod(entry.size):
            problems.append(f"{key}: the saved shards cover {sum(math.prod(c.sizes) for c in chunks)} of its "
                            f"{math.prod(entry.size)} elements (shards missing)")
    return problems


def refusal(path: str | Path, problems: list[str], saved_world: int | None, world: int) -> CheckpointMismatch:
    """The error a run stops with when the checkpoint at ``path`` does not fit it."""
    listed = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more"
                                                 if len(problems) > MAX_LISTED else "")
    saved = f"saved at world size {saved_world}" if saved_world else "world size not recorded"
    return CheckpointMismatch(
        f"checkpoint {Path(path)} ({saved}; this run has {world}) does not fit this run: {listed} (saved with "
        f"another model, optimizer or layout, or files lost since). Nothing was loaded and nothing in "
        f"{Path(path).parent} was changed; point fault.checkpoint_dir elsewhere to start afresh")


def gathered(path: str | Path) -> dict:
    """The checkpoint at ``path`` with every tensor whole (nested as it was saved), read in this process alone."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = io.BytesIO()
    dcp_to_torch_save(str(path), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Where two nested state dicts differ, bit for bit (one line per entry; [] when they are identical)."""
    found = [f"{prefix}{k}: only in one" for k in sorted(set(a) ^ set(b), key=str)]
    for key in sorted(set(a) & set(b), key=str):
        x, y, name = a[key], b[key], f"{prefix}{key}"
        if isinstance(x, dict) and isinstance(y, dict):
            found += differences(x, y, name + ".")
        elif torch.is_tensor(x) and torch.is_tensor(y):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                found.append(f"{name}: tensors differ")
        elif x != y:
            found.append(f"{name}: {x!r} != {y!r}")
    return found
