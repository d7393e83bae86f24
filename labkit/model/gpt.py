"""A GPT decoder you can read in one sitting (after nanoGPT).

Token + learned position embeddings → ``n_layer`` pre-norm blocks (LayerNorm → causal
self-attention → residual, LayerNorm → 4× MLP → residual) → final LayerNorm → a language-model
head that *shares its weight* with the token embedding (weight tying saves V·d parameters
and usually helps small models). With ``model.moe`` some blocks' MLPs are mixtures of experts
(:mod:`labkit.model.moe`): E MLPs of this shape, each token sent through k of them by a router.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from labkit.model.attention import get_attention
from labkit.model.init import initialise
from labkit.model.moe import MoE, MoEShape, moe_layers, routing_stats, step_statistics


@dataclass
class GPTShape:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False
    attention: str = "sdpa"
    recompute: str = "none"  # activation checkpointing: "none", "selective" (attention) or "full" (each block)
    moe: Optional[MoEShape] = None  # mixtures of experts in place of some MLPs (labkit.model.moe); None: dense

    @classmethod
    def from_config(cls, model_cfg, vocab_size: int, attention: str = "sdpa") -> "GPTShape":
        return cls(vocab_size=model_cfg.vocab_size or vocab_size, block_size=model_cfg.block_size,
                   n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, n_embd=model_cfg.n_embd,
                   dropout=model_cfg.dropout, bias=model_cfg.bias, attention=attention,
                   recompute=getattr(model_cfg, "recompute", "none"),
                   moe=MoEShape.from_config(getattr(model_cfg, "moe", None)))


class CausalSelfAttention(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.n_embd, 3 * s.n_embd, bias=s.bias)
        self.proj = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.dropout = nn.Dropout(s.dropout)
        self.attend = get_attention(s.attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.fc = nn.Linear(s.n_embd, 4 * s.n_embd, bias=s.bias)
        self.proj = nn.Linear(4 * s.n_embd, s.n_embd, bias=s.bias)
        self.dropout = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def feed_forward(s: GPTShape, layer: int) -> nn.Module:
    """Block ``layer``'s MLP: the dense one, or on every ``moe.every``-th block a mixture of experts, each expert
    this MLP's shape (with ``moe.shared_expert``, one MLP more that every token goes through)."""
    if s.moe is None or not s.moe.replaces(layer):
        return MLP(s)
    shared = MLP(s) if s.moe.shared_expert else None
    return MoE(s.moe, s.n_embd, s.bias, s.dropout, shared=shared, layer=layer)


class Block(nn.Module):
    """Pre-norm transformer block. ``recompute`` trades compute for memory (activation checkpointing):
    instead of keeping what backward needs, keep only the inputs and run the forward again in backward.
    "selective" does it for attention alone, whose scores grow with seq² (Korthikanti et al. 2022);
    "full" for the whole block, keeping one tensor per layer."""

    def __init__(self, s: GPTShape, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.attn = CausalSelfAttention(s)
        self.ln_2 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.mlp = feed_forward(s, layer)
        self.recompute = s.recompute

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln_1(x))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "selective" and torch.is_grad_enabled():
            x = x + checkpoint(self._attend, x, use_reentrant=False)
        else:
            x = x + self._attend(x)
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class CrossEntropy(nn.Module):
    """The language-model loss: mean cross-entropy over every position (nats/token), computed in fp32.

    A module, so a parallel layout can swap it (tensor parallelism computes it from vocabulary slices:
    ``labkit.parallel.tp.model.VocabParallelCrossEntropy``)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """``forward`` is three parts a parallel layout can take apart: :meth:`embed` (ids → activations),
    the ``blocks``, and :meth:`head` (activations → logits); ``criterion`` turns logits into the loss."""

    def __init__(self, shape: GPTShape, init_seed: Optional[int] = None):
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.wpe = nn.Embedding(shape.block_size, shape.n_embd)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape, layer) for layer in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd, bias=shape.bias)
        self.lm_head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.criterion = CrossEntropy()
        # where each token of a forward's sequence sits in the whole sequence: None, in order (0, 1, …, T − 1);
        # context parallelism sets this rank's chunks' positions (labkit.parallel.cp.model)
        self.position_ids: Optional[torch.Tensor] = None
        if not self.wte.weight.is_meta:  # on the meta device: shapes only, each rank makes its part real later
            seed = int(torch.randint(2**62, ())) if init_seed is None else init_seed
            initialise(self, shape.n_layer, seed)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of ``idx`` (B, T) → (B, T, n_embd)."""
        T = idx.size(1)
        if T > self.shape.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.shape.block_size}")
        pos = torch.arange(T, device=idx.device) if self.position_ids is None else self.position_ids.to(idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm and the (tied) output layer: activations → logits."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Logits for every position; with ``targets`` also the mean cross-entropy (nats/token), plus in training
        the mixture-of-experts layers' auxiliary balancing loss (``model.moe.balance: aux_loss``)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = self.criterion(logits, targets)
        return logits, loss if self.shape.moe is None else loss + self.balance_loss()

    def balance_loss(self):
        """The sum of the MoE layers' auxiliary losses from this forward (0 for a dense GPT, in evaluation, and
        with another ``balance``): Switch Transformer adds one per layer (``labkit.model.moe.switch_aux_loss``)."""
        return sum(m.aux_loss for m in moe_layers(self) if m.aux_loss is not None)

    def routing_stats(self) -> list[dict]:
        """Each MoE layer's routing since its tally was last reset, on this rank: its block, load per expert,
        max/mean load and drop rate (``labkit.model.moe.routing_stats``)."""
        layers = moe_layers(self)
        return [{"layer": m.layer, **routing_stats(c)} for m, c in zip(layers, step_statistics(layers))]
