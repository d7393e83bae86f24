"""Every parameter's first value from two things alone: the run's seed and the parameter's name in the GPT.

A model too big for one rank cannot be built whole and then cut (the reason model parallelism exists), so
labkit's trainer builds the GPT on the ``meta`` device — shapes, no memory — cuts it there (a pipeline
stage, tensor-parallel slices, FSDP2 shards) and only then makes each rank's part real
(:func:`materialise`). For every layout to start from exactly the weights of the one-process run, a
parameter's value cannot depend on the order the parameters were drawn in (a rank holding stage 3 never
draws stages 0–2); here it depends on its name: ``blocks.5.mlp.fc.weight`` is drawn by its own generator,
seeded from (seed, name). A rank holding a slice draws the whole tensor, keeps its slice and drops the rest:
one parameter at a time, so the largest parameter is the most a rank ever holds beyond its part.

The values follow GPT-2 (``labkit.model.gpt``): weights of linear layers and embeddings ~ N(0, 0.02²),
residual projections ~ N(0, (0.02/√(2L))²), biases 0, layer-norm weights 1. A mixture of experts
(``labkit.model.moe``) follows the same rules by name: its router's weight ~ N(0, 0.02²), its stacked experts'
``experts.fc.weight`` and ``experts.proj.weight`` as an MLP's (every expert drawn apart, from one generator), and
the router's ``score_bias`` — a buffer, made real here as the parameters are — 0.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
import torch.nn as nn

TIED = {"lm_head.weight": "wte.weight"}  # the output layer is the token embedding (weight tying)


def parameter_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: the same on every rank, whatever else it holds."""
    return (int(seed) * 1_000_003 + zlib.crc32(TIED.get(name, name).encode())) % (2**63 - 1)


def initial_value(name: str, size: torch.Size | tuple, n_layer: int, seed: int) -> torch.Tensor:
    """Parameter ``name``'s first value (fp32, on the CPU, whole), given the GPT's layer count."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias"):  # a layer's bias; a router's score_bias (a buffer)
        return torch.zeros(size)
    if ".ln_" in f".{name}":  # ln_1, ln_2, ln_f: a layer norm's weight
        return torch.ones(size)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(size).normal_(0.0, std, generator=generator)


def is_meta(tensor: torch.Tensor) -> bool:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's own slice
    return local.is_meta


def local_part(whole: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's part of ``whole`` under DTensor ``placements`` on ``mesh``: along each sharded mesh dimension,
    ``torch.chunk``'s piece at this rank's coordinate (empty past the last piece), as DTensor and FSDP2 cut.
    (Not torch's ``compute_local_shape_and_global_offset``: it caches by mesh, and a dry run builds one rank after
    another in one process, each on an equal mesh.)"""
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            pieces = torch.chunk(whole, mesh.size(mesh_dim), dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            whole = pieces[index] if index < len(pieces) else whole.narrow(placement.dim, 0, 0)
    return whole


def _real(p: nn.Parameter, whole: torch.Tensor, device) -> nn.Parameter:
    """``p`` made real from its whole value: a DTensor (TP or FSDP2) keeps its own slice of it. Flags set on
    ``p`` (``sequence_parallel``) carry over."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = local_part(whole, p.device_mesh, p.placements).clone()  # its own storage: the whole one is freed
        local = local.to(device=device, dtype=p.dtype)
        value = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
    else:
        value = whole.to(device=device, dtype=p.dtype)
    real = nn.Parameter(value, requires_grad=p.requires_grad)
    for flag, setting in vars(p).items():
        if not flag.startswith("_"):
            setattr(real, flag, setting)
    return real


def materialise(module: nn.Module, n_layer: int, seed: int, device,
                name_of: Callable[[str], str] = lambda name: name) -> nn.Module:
    """Make every parameter of ``module`` still on the meta device real, in place, on ``device``.

    ``name_of`` maps a parameter's name in ``module`` to its name in the whole GPT (a pipeline stage's
    ``blocks.0`` may be the GPT's ``blocks.6``). A parameter two modules share (a tied embedding) stays shared.
    Buffers still on the meta device (a router's ``score_bias``) are made real the same way, by name."""
    made: dict[int, nn.Parameter] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for key, p in list(owner._parameters.items()):
            if p is None or not is_meta(p):
                continue
            if id(p) not in made:
                name = name_of(f"{prefix}.{key}" if prefix else key)
                made[id(p)] = _real(p, initial_value(name, p.shape, n_layer, seed), device)
            owner._parameters[key] = made[id(p)]
        for key, b in list(owner._buffers.items()):
            if b is not None and is_meta(b):
                name = name_of(f"{prefix}.{key}" if prefix else key)
                owner._buffers[key] = initial_value(name, b.shape, n_layer, seed).to(device=device, dtype=b.dtype)
    return module


def initialise(module: nn.Module, n_layer: int, seed: int) -> None:
    """Overwrite a real module's parameters with their first values (the one-process GPT, built whole)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(initial_value(name, p.shape, n_layer, seed))
