"""Deterministic, sharded, resumable batches for data-parallel training.

The one idea: fix the *global* batch first, then split it among processes.

Every epoch shuffles the sample indices with a seed everybody knows
(``seed + epoch``).  Step t of an epoch owns B = micro * world_size * accum
consecutive positions of that permutation: its global batch.  Rank r's k-th
micro-batch of the step is the slice

    t*B + k*world_size*micro + r*micro + j,   j = 0 .. micro-1

so the ranks read disjoint samples, and together (all ranks, all k) they read
exactly the global batch that one process with the same B reads at step t.
Since the gradient of a mean loss over a batch is the mean of the gradients
of its parts, data-parallel training sees the same gradients as
single-process training on the full batch, whatever the number of GPUs.

Here "rank" and "world_size" mean the data-parallel coordinate and degree
(``labkit.parallel.mesh``): ranks that differ only in their tensor- or
pipeline-parallel coordinate hold parts of one replica and read the same samples.

Nothing is communicated to agree on the order: each rank recomputes the same
permutation from the seed.  And the position in the stream is three integers
(epoch, step, micro-batch), so a checkpoint can resume it exactly.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

from .corpora import load_metadata, resolve_dataset, true_nll
from .tokenizer import Tokenizer, build_tokenizer


class TokenDataset:
    """Non-overlapping windows of a token stream, as (input, target) pairs.

    Sample i is tokens[i*block : i*block + block + 1]: x is its first `block`
    tokens and y the same window shifted by one, so y[j] is the token that
    follows x[:j+1] -- next-token prediction at every position at once.
    Consecutive windows share one token (the last target of i is the first
    input of i+1), hence len = (n - 1) // block.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int):
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} "
                             f"and dtype {tokens.dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one sample of block_size "
                             f"{block_size} (needs {block_size + 1}); use a smaller block_size "
                             "or a longer text")
        self.tokens = tokens.long().contiguous()
        self.block_size = block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (len(indices), block_size) in one gather."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)})")
        windows = self.tokens[indices[:, None] * self.block_size + self._offsets]
        return windows[:, :-1], windows[:, 1:]


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last `val_fraction` of the stream is validation.

    A contiguous tail, not a random subset: random windows would overlap
    training text and flatter the validation loss.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


VALIDATION_SEED = 0
"""The validation order, whatever ``run.seed``: runs with different seeds are judged on the same tokens."""


def validation_loader(val_ds: TokenDataset, micro_batch_size: int, rank: int = 0,
                      world_size: int = 1) -> ShardedLoader:
    """This rank's validation micro-batches, in an order that does not follow ``run.seed``.

    Comparing two runs that differ only in seed (or in compressor, or in sync mode) is then a
    paired comparison on the same tokens: a 64k-token sample's own noise (~0.005 nats) would
    otherwise swamp differences of a few thousandths of a nat near the entropy floor.
    """
    return ShardedLoader(val_ds, micro_batch_size, rank, world_size, 1, VALIDATION_SEED)


def validation_floor(dataset: Union[str, Path], val_ds: TokenDataset, val_fraction: float,
                     micro_batch_size: int, world_size: int, eval_batches: int) -> Optional[float]:
    """The best possible model's mean loss on exactly the tokens an evaluation scores; None if unknown.

    The entropy floor is a mean over infinitely many tokens; a validation loss is measured on a
    few tens of thousands. On those tokens the generating process itself scores a little above or
    below the floor (:func:`labkit.data.corpora.true_nll`), and every model evaluated on them shares
    that offset. ``val_loss - validation_floor`` is then the model's own excess (an estimate of its
    KL divergence from the truth), free of the sample's luck: the fair "gap above the floor".
    Only for this kit's synthetic corpora, read one token per character.
    """
    path = resolve_dataset(dataset)
    meta = load_metadata(path)
    nll = true_nll(read_text(path), meta) if meta else None  # a user's own text has no known process
    if nll is None:
        return None
    val_nll = split_tokens(torch.from_numpy(nll), val_fraction)[1]
    if len(val_nll) != len(val_ds.tokens):
        raise ValueError(f"{path.name}: {len(val_ds.tokens)} validation tokens but {len(val_nll)} characters; "
                         "the validation floor needs one token per character")
    block, total, count = val_ds.block_size, 0.0, 0
    for rank in range(world_size):
        loader = validation_loader(val_ds, micro_batch_size, rank, world_size)
        for _ in range(eval_batches):
            targets = loader.next_indices()[:, None] * block + 1 + torch.arange(block)
            total, count = total + val_nll[targets].sum().item(), count + targets.numel()
    return total / count


class ShardedLoader:
    """This rank's micro-batches of a seeded, globally agreed sample order."""

    def __init__(self, dataset: TokenDataset, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, grad_accum: int = 1, seed: int = 0):
        for name, value in [("micro_batch_size", micro_batch_size), ("world_size", world_size),
                            ("grad_accum", grad_accum)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.dataset = dataset
        self.micro = micro_batch_size
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.seed = seed
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples (of block_size {dataset.block_size}) but one "
                f"global batch needs {self.global_batch_size} = micro_batch_size {micro_batch_size} "
                f"x world_size {world_size} x grad_accum {grad_accum}; lower one of these or "
                "block_size, or use a longer text"
            )
        self.epoch = self.step_in_epoch = self.micro_index = 0
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def global_batch_size(self) -> int:
        return self.micro * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches per epoch; the remainder is dropped (same on every rank)."""
        return len(self.dataset) // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of samples in `epoch`: identical on every rank."""
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=generator), epoch
        return self._perm

    def micro_batch_indices(self, epoch: int, step: int, micro: int) -> torch.Tensor:
        """Sample indices of this rank's micro-batch `micro` of `step` in `epoch`."""
        start = (step * self.global_batch_size + micro * self.world_size * self.micro
                 + self.rank * self.micro)
        return self.permutation(epoch)[start:start + self.micro]

    def next_indices(self) -> torch.Tensor:
        """Sample indices of the next micro-batch; then advance.

        Micro-batches 0..grad_accum-1 of a step come in order, then the step
        advances, and after the last whole step the epoch does.
        """
        indices = self.micro_batch_indices(self.epoch, self.step_in_epoch, self.micro_index)
        self.micro_index += 1
        if self.micro_index == self.grad_accum:
            self.micro_index, self.step_in_epoch = 0, self.step_in_epoch + 1
            if self.step_in_epoch == self.steps_per_epoch:
                self.step_in_epoch, self.epoch = 0, self.epoch + 1
        return indices

    def next_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (micro_batch_size, block_size) int64, of :meth:`next_indices`."""
        return self.dataset.batch(self.next_indices())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_micro_batch()

    def step_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's ``grad_accum`` micro-batches, each read when it is pulled."""
        return itertools.islice(self, self.grad_accum)

    def state_dict(self) -> dict:
        """Where the stream stands. The same on every rank at a step boundary,
        so rank 0's copy in a checkpoint can be loaded by all ranks."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "micro": self.micro_index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        epoch, step, micro = int(state["epoch"]), int(state["step_in_epoch"]), int(state["micro"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch or not 0 <= micro < self.grad_accum:
            raise ValueError(
                f"loader state {dict(state)} does not fit this loader ({self.steps_per_epoch} steps "
                f"per epoch, grad_accum {self.grad_accum}); was it saved with a different dataset, "
                "block_size or global batch size?"
            )
        self.epoch, self.step_in_epoch, self.micro_index = epoch, step, micro
        self.seed = int(state["seed"])
        self._perm_epoch = -1  # the seed may have changed: recompute the permutation


def read_text(path: Path) -> str:
    """The file's exact text (no newline translation); a clear error if not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err}); convert it, e.g. with iconv") from None


def build_datasets(name_or_path: Union[str, Path], tokenizer_kind: str = "char", block_size: int = 64,
                   val_fraction: float = 0.1, datasets_dir: Union[str, Path, None] = None,
                   ) -> tuple[TokenDataset, Optional[TokenDataset], Tokenizer, Optional[dict]]:
    """(train, val, tokenizer, metadata) for a shipped corpus or any text file.

    The tokenizer is built from the whole text, so validation never meets an
    unknown character.  val is None when val_fraction is 0; metadata is None
    for a user's own file (no known entropy).
    """
    path = resolve_dataset(name_or_path, datasets_dir)
    text = read_text(path)
    tokenizer = build_tokenizer(tokenizer_kind, text)
    tokens = torch.from_numpy(np.ascontiguousarray(tokenizer.encode(text)))
    train, val = split_tokens(tokens, val_fraction)
    if val_fraction > 0 and len(val) < block_size + 1:
        raise ValueError(f"the validation split of {path.name} has {len(val)} tokens, fewer than "
                         f"block_size + 1 = {block_size + 1}; raise val_fraction or lower block_size")
    train_ds = _dataset_or_explain(train, block_size, f"the training split of {path.name}")
    val_ds = TokenDataset(val, block_size) if val_fraction > 0 else None
    return train_ds, val_ds, tokenizer, load_metadata(path)


def _dataset_or_explain(tokens: torch.Tensor, block_size: int, what: str) -> TokenDataset:
    try:
        return TokenDataset(tokens, block_size)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
