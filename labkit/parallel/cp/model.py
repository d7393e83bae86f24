"""A GPT trained with its sequences split over the cp axis: what changes, in three places.

1. **The tokens.** Each rank of a cp group reads the same sequences (the loader shards by dp coordinate) and keeps
   its chunks of each (:func:`sequence_part`: chunk r, or chunks r and 2·cp − 1 − r under ``head_tail``). Inputs and
   targets are cut alike, so the loss on a rank is the mean over its own tokens — and, every rank holding as many
   tokens as the next, the mean of the cp ranks' losses is the whole sequence's.
2. **Positions.** A token's position embedding is the one of its place in the *whole* sequence
   (:func:`labkit.parallel.cp.sharding.positions`), not of its place in the rank's chunk: ``GPT.position_ids``.
3. **Attention**, the one layer that mixes tokens: every attention module's ``attend`` becomes the chosen
   context-parallel attention over the cp group (ring, all-gather KV or Ulysses), whose bytes are counted on the
   timer the step sets for the cp axis. Everything else in a block works token by token and needs nothing.

The gradients: each cp rank's are its tokens' share of the same parameters' gradient, so the data-parallel strategy
averages them over dp × cp together (``labkit.parallel.mesh.GRADIENT_AXIS``) — a cp group is, for the optimizer,
one more set of replicas.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from labkit.parallel.cp import attention
from labkit.parallel.cp.sharding import positions, shard


def apply_context_parallel(model: nn.Module, cp_cfg, grid, device) -> nn.Module:
    """Make ``model`` (whole, or split over tp) attend over the grid's cp group, in place; cp = 1 leaves it.
    Its positions are placed on ``device`` once (not copied in every forward)."""
    if grid.size("cp") == 1:
        return model
    attend = partial(_attend, f=attention(cp_cfg.impl), group=grid.axis_group("cp"), layout=cp_cfg.layout)
    for module in model.modules():
        if hasattr(module, "attend"):  # the GPT's attention, and tensor parallelism's, keep their kernel here
            module.attend = attend
    model.position_ids = positions(model.shape.block_size, grid.coord("cp"), grid.size("cp"), cp_cfg.layout).to(device)
    return model


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f, group, layout: str):
    return f(q, k, v, group=group, layout=layout, causal=True)


def sequence_part(cp_cfg, grid):
    """A function taking a micro-batch's (B, T) token tensor to this rank's (B, T/cp) part of it (identity at
    cp = 1)."""
    cp = grid.size("cp")
    if cp == 1:
        return lambda tokens: tokens
    return partial(shard, rank=grid.coord("cp"), cp=cp, layout=cp_cfg.layout, dim=1)
