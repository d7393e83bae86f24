"""Dropout masks on a split model: a model-parallel RNG tracker (Megatron-LM's idea, Shoeybi et al. 2019 §3).

A dropout draws its mask from a random generator. On a split model two kinds of region need two kinds of mask:

* **replicated** — every rank of a tp group holds the *same* activation (after a row-parallel layer's all-reduce):
  the ranks must draw the *same* mask, or the copies drift apart and are no longer one model;
* **sharded** — each rank holds *different* tokens of the sequence (sequence parallelism's shards over tp, context
  parallelism's chunks over cp): the ranks must draw *different* masks, or every shard of a sequence is dropped
  in the same pattern (a correlation one process would never have).

The tracker keeps one generator per kind and every dropout forks into its region's one: the replicated generator is
seeded alike on every rank of a tp × cp group, the sharded one from this rank's shard (its cp coordinate, and its
tp coordinate under sequence parallelism). Anything else that draws from torch's default generator on one rank
only (rank 0 timing a matmul) cannot make the copies' masks drift. Data-parallel replicas draw alike, as
Megatron-LM's do by default (their tokens differ anyway); pipeline stages are offset, as Megatron's are.

Under context parallelism or sequence parallelism every dropout of labkit's GPT sees this rank's own tokens (the
embedding's output is already cut, the residual branches' outputs are reduce-scattered), so all are sharded; with
tensor parallelism alone all are replicated.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

SHARD_OFFSET = 2718  # Megatron-LM's offset of the model-parallel seed from the default one
STAGE_OFFSET = 100  # Megatron-LM's offset of each pipeline stage's seed


class RNGTracker:
    """Named generators; :meth:`fork` runs a block with torch's default CPU generator (and the current CUDA one)
    swapped for one of them, and keeps where it got to."""

    def __init__(self, seeds: dict[str, int], device: torch.device):
        self.device = torch.device(device)
        self.states = {}
        for name, seed in seeds.items():
            with torch.random.fork_rng(devices=self._cuda()):
                torch.manual_seed(seed)
                self.states[name] = self._get()

    def _cuda(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _get(self) -> tuple:
        return torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if self._cuda() else None)

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextmanager
    def fork(self, name: str):
        outside = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outside)


class TrackedDropout(nn.Dropout):
    """``nn.Dropout`` whose mask comes from the tracker's ``region`` generator."""

    def __init__(self, p: float, tracker: RNGTracker, region: str):
        super().__init__(p)
        self.tracker, self.region = tracker, region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork(self.region):
            return super().forward(x)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"


def seeds_for(seed: int, coord: dict[str, int], sizes: dict[str, int], sequence_parallel: bool) -> dict[str, int]:
    """This rank's two seeds: ``replicated`` alike over tp and cp (offset by pipeline stage), ``sharded`` also
    offset by the rank's shard of the sequence: its cp coordinate, × tp + its tp coordinate under sequence
    parallelism."""
    base = seed + STAGE_OFFSET * coord["pp"]
    shard = coord["cp"] * sizes["tp"] + coord["tp"] if sequence_parallel else coord["cp"]
    return {"replicated": base, "sharded": base + SHARD_OFFSET + 1 + shard}


def dropout_region(grid, sequence_parallel: bool) -> str | None:
    """Where labkit's GPT's dropouts are on this layout: "sharded", "replicated", or None (no split: torch's
    default generator, as one process draws)."""
    if grid.size("cp") > 1 or (grid.size("tp") > 1 and sequence_parallel):
        return "sharded"
    return "replicated" if grid.size("tp") > 1 or grid.size("pp") > 1 else None


def track_dropouts(model: nn.Module, seed: int, grid, sequence_parallel: bool, device) -> RNGTracker | None:
    """Swap every ``nn.Dropout`` with p > 0 of ``model`` (in place) for a :class:`TrackedDropout` of this layout's
    region. Returns the tracker (None when nothing is swapped)."""
    region = dropout_region(grid, sequence_parallel)
    dropouts = [m for m in model.modules() if type(m) is nn.Dropout and m.p > 0]
    if region is None or not dropouts:
        return None
    sizes = {axis: grid.size(axis) for axis in ("dp", "pp", "cp", "tp")}
    tracker = RNGTracker(seeds_for(seed, {axis: grid.coord(axis) for axis in sizes}, sizes, sequence_parallel),
                         device)
    swapped = {id(m): TrackedDropout(m.p, tracker, region) for m in dropouts}
    for holder in list(model.modules()):  # every place a dropout is held (a tp layer keeps its block's)
        for key, child in list(holder._modules.items()):
            if id(child) in swapped:
                holder._modules[key] = swapped[id(child)]
    return tracker
