"""One worker's copy of the model, seen as a flat vector — what the consistency models exchange.

Every mode in the lab trains with plain SGD (θ ← θ − η·g, η from ``optim.lr`` and its schedule):
with no optimizer state, the modes differ *only* in how updates are shared, and the identities the
tests check hold exactly (local SGD with H = 1 is gradient averaging; SSP with s = 0 is sync).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labkit.data import ShardedLoader
from labkit.model import GPT, GPTShape


class Replica:
    def __init__(self, cfg, shape: GPTShape, train_ds, worker: int, workers: int):
        torch.manual_seed(cfg.run.seed)  # every replica (and the server) starts from the same θ₀
        self.model = GPT(shape)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loader = ShardedLoader(train_ds, cfg.data.micro_batch_size, worker, workers, 1, cfg.run.seed)

    def vector(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().clone()

    def load_vector(self, vector: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(vector, self.params)

    def gradient(self) -> tuple[float, torch.Tensor]:
        """(loss, flat gradient) on this worker's next micro-batch."""
        x, y = self.loader.next_micro_batch()
        for p in self.params:
            p.grad = None
        _, loss = self.model(x, y)
        loss.backward()
        return loss.item(), torch.cat([p.grad.reshape(-1) for p in self.params])

    def timed_gradient(self, faults, rank: int, log: "ProgressLog") -> tuple[float, float, torch.Tensor, float]:
        """(start time, loss, gradient, seconds computing) — a straggler's computing stretched by its factor."""
        t_start = log.now()
        loss, grad = self.gradient()
        busy = log.now() - t_start
        return t_start, loss, grad, busy + faults.slow_down(rank, busy)

    def sgd_step(self, grad: torch.Tensor, lr: float) -> None:
        with torch.no_grad():
            self.load_vector(parameters_to_vector(self.params) - lr * grad)


class ProgressLog:
    """One JSON line per step (or per applied update), times in seconds after the run's t0."""

    def __init__(self, path: Path, t0: float):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.t0 = open(path, "w", buffering=1), t0  # a restarted attempt starts the log afresh

    def now(self) -> float:
        return time.time() - self.t0

    def write(self, **record) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


class Snapshots:
    """θ every ``every`` steps, kept in memory and saved at the end: divergence is computed afterwards,
    from exact parameters, without adding traffic to the (possibly partitioned) network.

    Each snapshot is the whole parameter vector (4 bytes a parameter), so ``comm.measure_every`` is
    what bounds a run's memory and disk: every step of a 100k-parameter model at 80 steps/s is 32 MB/s.
    """

    def __init__(self, every: int):
        self.every, self.times, self.steps, self.vectors = every, [], [], []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, step: int, t: float, vector: torch.Tensor) -> None:
        self.times.append(t)
        self.steps.append(step)
        self.vectors.append(vector.detach().clone())

    def save(self, path: Path) -> None:
        """Written under a temporary name, then renamed: a reader never sees half a file."""
        partial = path.with_name(f".{path.name}.partial")
        torch.save({"times": self.times, "steps": self.steps,
                    "vectors": torch.stack(self.vectors) if self.vectors else torch.empty(0)}, partial)
        partial.replace(path)
