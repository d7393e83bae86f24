"""Sweeps: train a grid of model sizes × token budgets and record what each point reached.

A scaling law is only as good as the points it is fitted to, so every point records what a fit
needs and nothing approximate: the exact parameter count of the model that ran, the tokens it saw,
FLOPs both as the 6·N·D rule of thumb and as labkit's exact per-token count (which includes
attention), the final validation loss, a smoothed final training loss, and the whole training
curve (downsampled) for Chinchilla's approach 1.

A sweep is resumable: each finished point is appended to ``results.jsonl`` as it completes, and a
rerun skips the points already there — a sweep interrupted after 17 of 20 points costs 3 more runs,
not 20. Each point's learning-rate schedule is sized to its own length (cosine to the end), as
Hoffmann et al. insist: a curve cut from a longer schedule overstates the loss at its end.

The spec is a small YAML file (``configs/scaling/*.yaml``)::

    name: markov-sweep
    base: ../quickstart.yaml      # a labkit config, relative to this file
    overrides: {run.eval_every: 0}
    nproc: 1
    sizes:                        # model shapes (any model.* keys)
      - {model.n_layer: 2, model.n_embd: 16, model.n_head: 2}
    tokens: [2.5e5, 1.0e6]        # a grid: every size trained on each number of tokens
    isoflops: [1.0e11]            # IsoFLOP sets: every size trained on D = C / (6 N) tokens

Each IsoFLOP point records the budget it targeted (``budget``): approach 2 groups points by it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from labkit.config import Config, load_config
from labkit.validation import validate
from labkit.experiments import run_to_end

RESULTS = "results.jsonl"
CURVE_POINTS = 40


@dataclass
class SweepSpec:
    name: str
    base: Config
    sizes: list[dict]
    tokens: list[float]
    isoflops: list[float] = field(default_factory=list)
    nproc: int = 1
    source: Optional[Path] = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "SweepSpec":
        path = Path(path)
        raw = yaml.safe_load(path.read_text()) or {}
        unknown = sorted(set(raw) - {"name", "base", "overrides", "nproc", "sizes", "tokens", "isoflops"})
        if unknown:
            raise ValueError(f"{path}: unknown sweep key(s) {unknown}; a sweep has name, base, overrides, nproc, "
                             "sizes, tokens and isoflops")
        if not raw.get("sizes") or not (raw.get("tokens") or raw.get("isoflops")):
            raise ValueError(f"{path}: a sweep needs at least one entry in 'sizes', and token budgets in 'tokens' "
                             "or FLOP budgets in 'isoflops'")
        base_path = (path.parent / raw["base"]) if raw.get("base") else None
        base = load_config(base_path, {k: v for k, v in (raw.get("overrides") or {}).items()})
        tokens, isoflops = ([float(t) for t in raw.get(key) or []] for key in ("tokens", "isoflops"))
        if any(not math.isfinite(t) or t <= 0 for t in tokens + isoflops):
            raise ValueError(f"{path}: every budget in 'tokens' and 'isoflops' must be a positive number")
        return cls(raw.get("name") or path.stem, base, list(raw["sizes"]), tokens, isoflops,
                   int(raw.get("nproc", 1)), path, raw)

    def tokens_per_step(self) -> int:
        return self.base.data.batch_size * self.base.model.block_size

    def points(self) -> list[tuple[str, dict]]:
        """(name, config overrides) per point; steps = tokens / tokens per step, at least 10."""
        out = []
        for size in self.sizes:
            shape = "-".join(f"{k.split('.')[-1]}{v}" for k, v in size.items())
            budgets = [(t, None) for t in self.tokens]
            budgets += [(c / (6 * self.params(size)), c) for c in self.isoflops]
            for tokens, flops in budgets:
                steps = max(10, round(tokens / self.tokens_per_step()))
                name = f"{shape}-steps{steps}" if flops is None else f"{shape}-C{flops:.1e}"
                out.append((name, {**size, "run.steps": steps, "run.eval_every": steps,
                                   "run.name": f"{self.name}-{name}", "_budget": flops}))
        return out

    def params(self, size: dict) -> int:
        """The exact parameter count of the model a point trains (what 6·N·D is computed with)."""
        from labkit.data import load_metadata
        from labkit.model import GPTShape, count_params

        cfg = self.base.replace(**size)
        vocab = cfg.model.vocab_size or len((load_metadata(cfg.data.dataset) or {}).get("alphabet", "")) or None
        if vocab is None:
            raise ValueError(f"isoflops needs the vocabulary size of {cfg.data.dataset!r}: set model.vocab_size")
        return count_params(GPTShape.from_config(cfg.model, vocab))["total"]

    def check(self) -> None:
        """Validate every point's config before the first run starts."""
        for _, overrides in self.points():
            validate(self.base.replace(**config_overrides(overrides)), nproc=self.nproc)


def config_overrides(point: dict) -> dict:
    return {k: v for k, v in point.items() if not k.startswith("_")}


def read_results(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / RESULTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def downsample(values: list, n: int) -> list:
    if len(values) <= n:
        return list(values)
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def point_result(name: str, run, tokens_per_step: int, budget: Optional[float] = None) -> dict:
    """What a fit needs from one finished run."""
    s, m = run.summary, run.metrics
    steps = len(m["step"])
    tokens = steps * tokens_per_step
    tail = m["loss"][-max(1, steps // 10):]
    window = max(1, steps // CURVE_POINTS)
    smoothed = [sum(m["loss"][max(0, i - window + 1): i + 1]) / len(m["loss"][max(0, i - window + 1): i + 1])
                for i in range(steps)]
    curve = downsample([[(i + 1) * tokens_per_step, smoothed[i]] for i in range(steps)], CURVE_POINTS)
    return {"name": name, "params": s["params"]["total"], "non_embedding_params": s["params"]["non_embedding"],
            "tokens": tokens, "steps": steps, "flops_6nd": 6 * s["params"]["total"] * tokens,
            "flops": s["flops_per_token"] * tokens, "val_loss": s.get("val_loss"),
            "train_loss": sum(tail) / len(tail), "tokens_per_s": s.get("tokens_per_s"),
            "wall_time_s": s.get("wall_time_s"), "budget": budget, "curve": curve,
            "entropy_floor": s.get("entropy_floor"), "run_dir": str(run.run_dir)}


def run_sweep(spec: SweepSpec, out_dir: str | Path, on_progress: Optional[Callable[[str], None]] = None,
              limit: Optional[int] = None) -> list[dict]:
    """Run the points not yet in ``out_dir/results.jsonl`` (at most ``limit`` of them); return all results."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.check()
    if spec.source is not None:
        (out_dir / "sweep.yaml").write_text(yaml.safe_dump(spec.raw, sort_keys=False))
    done = {r["name"] for r in read_results(out_dir)}
    todo = [(n, o) for n, o in spec.points() if n not in done][:limit]
    say = on_progress or (lambda text: None)
    for i, (name, overrides) in enumerate(todo):
        say(f"[{i + 1}/{len(todo)}] {name} ({len(done)} done before)")
        start = time.time()
        run = run_to_end(spec.base.replace(**config_overrides(overrides)), spec.nproc, name)
        row = point_result(name, run, spec.tokens_per_step(), overrides["_budget"])
        with open(out_dir / RESULTS, "a") as f:  # one line per finished point: an interrupted sweep resumes
            f.write(json.dumps(row) + "\n")
        say(f"[{i + 1}/{len(todo)}] {name}: val loss {row['val_loss']:.4f} in {time.time() - start:.0f} s")
    return read_results(out_dir)
