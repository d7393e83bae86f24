"""Optimizers and the learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``.

Warm-up matters because Adam's second-moment estimates are noisy in the first steps; a small
learning rate there avoids a destructive early update. Too short a warm-up shows as an early spike, and
a run that compresses its gradients with error feedback can stay behind long after it: the compression
benchmark's warm-up and early-spike measurements are steps ``warmup`` and ``early_spike`` of
``benchmarks/results/compression_history.jsonl``. Weight decay is applied to matrices (weights of matmuls
and embeddings) only, not to biases and LayerNorm gains (as in GPT-2/nanoGPT).

Weight decay is a regulariser: it earns its keep when the data repeats. On a stream where no token is
seen twice it only pulls weights off the optimum; the compression benchmark measured what decay did to
uncompressed and compressed runs there (step ``weight_decay`` of the same file).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "adafactor": torch.optim.Adafactor}


def lr_at(step: int, optim_cfg, total_steps: int) -> float:
    o = optim_cfg
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (o.lr - o.min_lr)


def param_groups(model: nn.Module, optim_cfg) -> list[dict]:
    """Two groups: matrices (decayed) and vectors (not decayed); frozen parameters left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_class_and_kwargs(optim_cfg) -> tuple[type, dict]:
    """The torch.optim class named by ``optim.name`` and its keyword arguments from the config."""
    cls = OPTIMIZERS[optim_cfg.name]
    if cls is torch.optim.SGD:
        return cls, {"lr": optim_cfg.lr, "momentum": optim_cfg.beta1}
    if cls is torch.optim.Adafactor:
        return cls, {"lr": optim_cfg.lr}
    return cls, {"lr": optim_cfg.lr, "betas": (optim_cfg.beta1, optim_cfg.beta2)}


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class_and_kwargs(optim_cfg)
    return cls([g for g in param_groups(model, optim_cfg) if g["params"]], **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
