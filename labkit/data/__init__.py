"""Data for the labs: shipped corpora with known entropy, tokenizers, and a
sharded loader whose batches do not depend on how many processes read them.

    from labkit.data import build_datasets, ShardedLoader
    train, val, tok, meta = build_datasets("markov", "char", block_size=64, val_fraction=0.1)
    loader = ShardedLoader(train, micro_batch_size=8, rank=0, world_size=1, grad_accum=1, seed=0)
    x, y = loader.next_micro_batch()

Names are re-exported lazily (PEP 562): importing the package does not import
its modules, so ``python -m labkit.data.corpora`` runs the module once, as
``__main__``, instead of also finding an already-imported copy.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "generate": "corpora",
    "available_datasets": "corpora",
    "resolve_dataset": "corpora",
    "load_metadata": "corpora",
    "DatasetNotFoundError": "corpora",
    "DATASETS_DIR": "corpora",
    "CharTokenizer": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "TokenDataset": "loader",
    "ShardedLoader": "loader",
    "VALIDATION_SEED": "loader",
    "validation_loader": "loader",
    "validation_floor": "loader",
    "true_nll": "corpora",
    "split_tokens": "loader",
    "build_datasets": "loader",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # let editors and type checkers see the real names
    from .corpora import (DATASETS_DIR, DatasetNotFoundError, available_datasets, generate,  # noqa: F401
                          load_metadata, resolve_dataset, true_nll)
    from .loader import (VALIDATION_SEED, ShardedLoader, TokenDataset, build_datasets, split_tokens,  # noqa: F401
                         validation_floor, validation_loader)
    from .tokenizer import ByteTokenizer, CharTokenizer, build_tokenizer  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # cache: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
