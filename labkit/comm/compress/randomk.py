"""``randomk``: send k entries chosen at random — *without* error feedback, as a contrast.

If every rank picks the *same* random indices (a seed shared by all ranks, changed every step),
the k selected values can simply be all-reduced: 2·(p−1)/p·4k bytes, no indices on the wire at all
— cheaper than top-k, and its cost does not grow with p.

We scale the kept entries by n/k (option ``unbiased=True``, the default), which makes the
compressor *unbiased*: each entry is kept with probability k/n, so E[(n/k)·randk(g)] = g. The
price is variance: the estimate's squared error is (n/k − 1)·‖g‖² on average, 99× the gradient's
own norm² at ratio 0.01. With ``unbiased=False`` the update is small but biased towards zero —
every step moves only k/n of the way.

There is deliberately no error feedback. Either way the sum of applied updates wanders away from
the sum of true gradients — a random walk of size ~sqrt(T·n/k)·‖g‖ (unbiased) or a lag that grows
like (1 − k/n)·T·‖g‖ (biased) — while top-k and sign *with* error feedback stay within one bounded
error buffer of it. That difference is the lesson of this compressor.
"""
from __future__ import annotations

import torch

from labkit.comm.compress.base import COMPRESSORS, Compressor
from labkit.comm.compress.options import ratio_problems, require_bool, require_fraction, require_int
from labkit.comm.compress.topk import kept_count


def shared_generator(seed: int, bucket_index: int, step: int) -> torch.Generator:
    """A random generator in the same state on every rank for the same (seed, bucket, step).

    Python hashes tuples of ints identically in every process (only str hashing is salted).
    """
    return torch.Generator().manual_seed(hash((seed, bucket_index, step)) & (2**63 - 1))


def shared_indices(n: int, k: int, seed: int, bucket_index: int, step: int) -> torch.Tensor:
    """k distinct indices in [0, n), the same on every rank for the same (seed, bucket, step).

    O(n) per call (a random permutation), fine for a lab.
    """
    return torch.randperm(n, generator=shared_generator(seed, bucket_index, step))[:k]


@COMPRESSORS.register
class RandomK(Compressor):
    name, order = "randomk", 60
    defaults = {"ratio": 0.01, "seed": 0, "unbiased": True}
    config_options = {"ratio": "comm.compression_ratio", "seed": "run.seed"}

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        return ratio_problems(cfg)

    def __init__(self, timer, group=None, **options):
        super().__init__(timer, group=group, **options)
        self.steps: dict[int, int] = {}  # per bucket index; not tied to a layout: indices keep changing

    def check_options(self, options: dict) -> None:
        require_fraction(self.name, "ratio", options["ratio"])
        require_int(self.name, "seed", options["seed"], 0)
        require_bool(self.name, "unbiased", options["unbiased"])

    def next_indices(self, bucket_index: int, n: int) -> torch.Tensor:
        """This step's shared indices for the bucket; advances the bucket's step counter."""
        step = self.steps.get(bucket_index, 0)
        self.steps[bucket_index] = step + 1
        return shared_indices(n, kept_count(self.options["ratio"], n), self.options["seed"], bucket_index, step)

    def global_state(self) -> dict:
        return {"steps": dict(self.steps)}

    def load_global_state(self, state: dict) -> None:
        self.steps = dict(state["steps"])

    def _allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        indices = self.next_indices(bucket_index, grad.numel())
        self.count_sent(bucket_index, indices)
        values = grad[indices]
        if self.options["unbiased"]:
            values.mul_(grad.numel() / indices.numel())
        self.all_reduce_sum(values).div_(self.world)
        return torch.zeros_like(grad).index_copy_(0, indices, values)
