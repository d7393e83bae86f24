"""Shared helpers for the tests."""
import tempfile
from pathlib import Path

from labkit.config import Config, load_config


def tiny_config(**dotted) -> Config:
    """A model small enough that a multi-process run takes a few seconds on 2 cores."""
    base = {
        "run.name": "test", "run.runs_dir": str(Path(tempfile.gettempdir()) / "labkit-test-runs"),
        "run.steps": 6, "run.eval_every": 0, "run.seed": 7,
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
        "data.batch_size": 8, "data.micro_batch_size": 4, "optim.warmup_steps": 2,
    }
    base.update(dotted)
    return load_config(None, base)
