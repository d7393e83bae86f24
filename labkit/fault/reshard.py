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
* :func:`relayout_plan` — a checkpoint of another *layout* (pipeline stages, DTensor's split q/k/v) loaded into a
  whole model per replica: each entry read whole under its old name(s), joined, and each rank's part copied in;
* :func:`gathered` — every tensor of a checkpoint whole, read by one process without a process group: what tests
  compare bit for bit between a checkpoint saved at world 4 and the same state saved again at world 2.

Under torchrun with elastic membership (``--nnodes 1:2``) a node lost for good leaves a smaller world; the restarted
workers resume from the newest checkpoint through the same path, and the resume event says the world size that
saved it and ``resharded: true`` (the dashboard's title shows the drop: ``2 → 1``).

The data loader's position is three integers of the *global* sample stream (``labkit.data.loader``): with the
global batch fixed, the new world reads exactly the samples the old one would have read next, each rank a
different share of them (more gradient accumulation per rank on fewer ranks).
"""
from __future__ import annotations

import io
import math
import re
from pathlib import Path

import torch

MAX_LISTED = 6  # problems named in a refusal; the rest are counted
PER_RANK = re.compile(r"^(rng|compressor)\.rank\d+\.")  # a rank's own share (labkit.fault.recovery.training_state):
# a rank that did not exist when the checkpoint was saved (a world grown back) keeps its own fresh one


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
        return None if PER_RANK.match(key) else f"{key} is not in the checkpoint"
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


# ---------------------------------------------------------------- another layout: tensors named or cut otherwise

STAGE_BLOCK = re.compile(r"^pp(\d+)\.model\.blocks\.(\d+)\.")
LABKIT_PARTS = re.compile(r"^(pp\d+_)?(tp|ep)\d+\.")  # labkit's own tensor-parallel slices, expert parts
FIRST_STAGE = ("wte", "wpe", "drop")  # what a pipeline's first stage holds besides its blocks (the rest: the last's)
QKV = ("q", "k", "v")  # DTensor tensor parallelism's split of attn.qkv (labkit.parallel.tp.dtensor)


PART_KEY = re.compile(r"^(pp|tp|ep)\d+[._]")  # a key of a model cut into parts (labkit.fault.recovery.model_part_key)


def shards_lost(problems: list[str]) -> bool:
    """Whether :func:`fit_problems` found files missing or short, or no metadata: no layout explains those."""
    return any(p.startswith(("shard file ", ".metadata ")) or "(shards missing)" in p for p in problems)


def relayout(path: str | Path, state: dict) -> tuple[dict | None, list[str]]:
    """(plan, []) to load the checkpoint at ``path`` into ``state`` from another layout, or (None, why not)."""
    flat = flat_state(state)
    if any(PART_KEY.match(k) for k in flat):
        problems = fit_problems(path, state)
        return None, problems + ["this run's model is cut into parts: a checkpoint of another layout loads into a "
                                 "whole model per replica only (pipeline and labkit tensor-parallel degree 1)"]
    saved = read_metadata(path).state_dict_metadata
    if not another_layout(saved):
        return None, fit_problems(path, state)
    plan, left = relayout_plan(saved, flat)
    return (None, left) if left else (plan, [])


def another_layout(saved) -> bool:
    """Whether a checkpoint's names are those of a layout that cuts the model: pipeline stages, labkit's
    tensor-parallel slices, DTensor tensor parallelism's split q, k and v."""
    return any(PART_KEY.match(k) or ".attn.q." in k for k in saved)


def relayout_plan(saved: dict, flat: dict) -> tuple[dict, list[str]]:
    """For a whole model (no pipeline stage, no labkit tensor-parallel slice of its own) loading a checkpoint of
    another layout: each entry of ``flat`` → the checkpoint entries it is made of (``saved``: the checkpoint's
    metadata of each), and the problems left.

    Two layouts are translated: a pipeline's stages (``pp0.model.blocks.0.…`` → ``model.blocks.{first + 0}.…``;
    the embeddings from the first stage, the head from the last) and DTensor tensor parallelism's split q, k and v
    (joined into ``attn.qkv``, rows [q | k | v]). ``optim.param_groups`` stay this run's own (the learning rate is a
    function of the step; the rest comes from the config)."""
    if any(LABKIT_PARTS.match(k) for k in saved):
        return {}, ["it was saved by labkit's own tensor-parallel (or expert-parallel) layers, whose slices are keyed "
                    "by their tp (ep) coordinate: it resumes at the same tp and ep degrees only (a checkpoint of "
                    "parallel.tp.impl=dtensor resumes at any tp degree)"]
    stages = blocks_per_stage(saved)
    plan, problems = {}, []
    for key, value in flat.items():
        own = key.startswith("optim.param_groups.") or (PER_RANK.match(key) and key not in saved)
        found = [] if own else sources(key, saved, stages)
        shape = None if found is None else joined_shape([saved[old] for old in found])
        if found is None:
            problems.append(f"{key} is not in the checkpoint, under this layout's name or another's")
        elif found and torch.is_tensor(value) and shape != tuple(value.shape):
            problems.append(f"{key} has shape {list(shape or ())} in the checkpoint ({', '.join(found)}), "
                            f"{list(value.shape)} here")
        else:
            plan[key] = found
    return plan, problems


def joined_shape(entries: list) -> tuple | None:
    """The shape of saved tensors joined as :func:`joined` joins them (None if one is not a tensor)."""
    sizes = [tuple(getattr(e, "size", None) or ()) if hasattr(e, "size") else None for e in entries]
    if None in sizes or not sizes:
        return None
    if len(sizes) == 1 or not sizes[0]:
        return sizes[0]
    return (sum(s[0] for s in sizes), *sizes[0][1:])


def blocks_per_stage(saved: set) -> list[int]:
    """How many blocks each pipeline stage of the checkpoint held ([] for a checkpoint of no pipeline)."""
    counts: dict[int, int] = {}
    for key in saved:
        if match := STAGE_BLOCK.match(key):
            stage, block = int(match[1]), int(match[2])
            counts[stage] = max(counts.get(stage, 0), block + 1)
    return [counts[s] for s in sorted(counts)]


def sources(key: str, saved: set, stages: list[int]) -> list[str] | None:
    """The checkpoint entries ``key`` (a whole model's) is made of; None if they are not all there."""
    section, fqn, stat = split_key(key)
    if section is None:
        return [key] if key in saved else None
    candidates = [[fqn]]
    if ".attn.qkv." in fqn:
        candidates.append([fqn.replace(".attn.qkv.", f".attn.{part}.") for part in QKV])
    for names in candidates:
        olds = [staged(section, name, stat, stages) for name in names]
        if all(old in saved for old in olds):
            return olds
    return None


def split_key(key: str) -> tuple[str | None, str, str]:
    """(section, parameter name, statistic) of a model or optimizer-state entry; (None, key, "") for the rest."""
    if key.startswith("model."):
        return "model.", key[len("model."):], ""
    if key.startswith("optim.state."):
        fqn, stat = key[len("optim.state."):].rsplit(".", 1)
        return "optim.state.", fqn, "." + stat
    return None, key, ""


def staged(section: str, fqn: str, stat: str, stages: list[int]) -> str:
    """The name of a whole model's entry in a checkpoint of ``stages`` pipeline stages (as is, without one)."""
    if not stages:
        return section + fqn + stat
    head, _, rest = fqn.partition(".")
    if head == "blocks":
        block, _, leaf = rest.partition(".")
        stage = next(s for s in range(len(stages)) if int(block) < sum(stages[:s + 1]))
        fqn = f"blocks.{int(block) - sum(stages[:stage])}.{leaf}"
    else:
        stage = 0 if head in FIRST_STAGE else len(stages) - 1
    return f"pp{stage}.{section}{fqn}{stat}"


def load_relayout(path: str | Path, state: dict, plan: dict, metadata) -> dict:
    """Load the checkpoint at ``path`` into ``state`` through ``plan`` (:func:`relayout_plan`): every entry read
    whole (each rank holds the whole model for a moment), joined where it was split, and each rank's part of it
    copied into ``state``'s tensors in place (a DTensor's local shard). Returns the state, non-tensors loaded."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    flat, mapping = flatten_state_dict(state)
    request = {old: whole_placeholder(metadata.state_dict_metadata[old], flat[key])
               for key, olds in plan.items() for old in olds}
    load(request, checkpoint_id=str(path))
    for key, olds in plan.items():
        if torch.is_tensor(flat[key]) and olds:
            place(flat[key], joined([request[old] for old in olds]))
        elif olds:
            flat[key] = request[olds[0]]
    return unflatten_state_dict(flat, mapping)


def whole_placeholder(entry, value):
    """What ``dcp.load`` fills with a whole saved tensor (a plain one of its shape), or ``value`` for other data."""
    size = getattr(entry, "size", None)
    return value if size is None else torch.empty(size, dtype=entry.properties.dtype)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """One saved tensor, or q, k and v joined by rows (a step count, the same in each: the first)."""
    return parts[0] if len(parts) == 1 or parts[0].dim() == 0 else torch.cat(parts)


@torch.no_grad()
def place(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` into ``target``: all of it, or, for a DTensor, the slice its local shard holds."""
    if not hasattr(target, "device_mesh"):
        target.copy_(whole)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(whole.shape, target.device_mesh, target.placements)
    target.to_local().copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


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
