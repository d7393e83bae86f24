"""How much GPU memory does training need? A per-GPU estimate, on paper, before any run.

Training memory has two parts, and the parallel techniques attack different ones:

* **Model states** — weights, gradients and optimizer state — grow with the parameter count Ψ.
  Tensor (``tp``) and pipeline (``pp``) parallelism split the *model*, so each GPU holds Ψ/(tp·pp)
  parameters. ZeRO (stages 1–3) then shards those states across the ``dp`` data-parallel copies.
* **Activations** — what the forward pass keeps for the backward pass — grow with batch ×
  sequence × hidden × layers. Tensor/sequence parallelism shard them; recomputation trades
  memory for a second forward pass.

Everything here is pure arithmetic: no torch, no GPU. The live runs record their real peaks,
and ``labkit.parallel.reports.data_parallel.predict_rank_memory`` gives the number they are compared with (it
reads each strategy's ZeRO stage from the strategy's own declaration, :mod:`labkit.parallel.spec`).

Sources:

* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", Fig. 1 (model states per GPU for stages 0–3).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  eq. 1–2 and Table 2 (activation bytes per transformer layer, fp16/bf16).

Units: 1 GB = 1e9 bytes, as in the ZeRO paper.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

# bytes per parameter: (weights, gradients, optimizer state). Adam keeps momentum and variance.
# "mixed" is the ZeRO paper's mixed-precision Adam: fp16/bf16 weights and grads, plus fp32 master
# weights, momentum and variance (K = 4 + 4 + 4 = 12). "fp32" keeps everything in fp32 (K = 8).
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}
RECOMPUTE_MODES = ("none", "selective", "full")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def format_bytes(n: float) -> str:
    """Human units, decimal like the ZeRO paper (GB = 1e9 bytes)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def gpt_param_count(n_layer: int, hidden: int, vocab: int = 0, seq_len: int = 0) -> int:
    """Parameters of a GPT: 12·L·h² + V·h + s·h.

    Each layer has 4h² in attention (Q, K, V, output projection) and 8h² in the MLP (h → 4h → h).
    V·h is the token embedding (tied with the output head); s·h the learned positional embedding
    (pass ``seq_len=0`` for rotary models such as Llama). Biases and LayerNorms (~13·L·h) are left
    out: under 0.1 % for any model where memory matters.
    """
    return 12 * n_layer * hidden**2 + vocab * hidden + seq_len * hidden


def zero_model_state_split(params: float, dp: int, stage: int, k: int = 12, weight_bytes: int = 2,
                           grad_bytes: int = 2) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per GPU under ZeRO stage 0–3 (ZeRO paper, Fig. 1).

    Each stage shards one more state across the ``dp`` ranks: stage 1 the optimizer state
    (P_os), stage 2 also the gradients (P_os+g), stage 3 also the weights (P_os+g+p). A rank
    only needs *its* shard of a state once the data-parallel collectives hand it the rest.
    """
    _require(params >= 0, f"params must be >= 0, got {params}")
    _require(dp >= 1, f"dp must be >= 1 (1 = no data parallelism), got {dp}")
    _require(stage in (0, 1, 2, 3), f"stage must be 0, 1, 2 or 3 (ZeRO stage), got {stage!r}")
    _require(min(k, weight_bytes, grad_bytes) >= 0, "k, weight_bytes and grad_bytes must be >= 0")
    weights = weight_bytes * params / (dp if stage >= 3 else 1)
    grads = grad_bytes * params / (dp if stage >= 2 else 1)
    optimizer = k * params / (dp if stage >= 1 else 1)
    return weights, grads, optimizer


def zero_model_state_bytes(params: float, dp: int, stage: int, k: int = 12, weight_bytes: int = 2,
                           grad_bytes: int = 2) -> float:
    """Total model-state bytes per GPU: (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N_d, 2Ψ+(2+K)Ψ/N_d, (2+2+K)Ψ/N_d.

    The paper's example — Ψ = 7.5e9, N_d = 64, K = 12 — gives 120, 31.4, 16.6 and 1.9 GB.
    """
    return sum(zero_model_state_split(params, dp, stage, k, weight_bytes, grad_bytes))


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               recompute: str = "none", sequence_parallel: bool = False, cp: int = 1) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al., Table 2).

    These are the paper's fp16/bf16 counts. Without parallelism a layer keeps
    s·b·h·(34 + 5·a·s/h) bytes: the 34 term is linear in s (inputs of the matmuls, GeLU,
    dropout masks, LayerNorms); the 5·a·s/h term is the a × s × s attention scores, softmax and
    its dropout — quadratic in s, which is why long sequences hurt.

    * Tensor parallelism t shards the 24 bytes inside attention/MLP and the scores, but not the
      10 bytes around LayerNorm and dropout: s·b·h·(10 + 24/t + 5·a·s/(h·t)).
    * Sequence parallelism also splits those 10 along s: s·b·h·(34 + 5·a·s/h)/t.
    * Selective recomputation redoes only the cheap-to-compute, huge attention core, dropping
      the 5·a·s/h term: s·b·h·(10 + 24/t), or 34·s·b·h/t with sequence parallelism.
    * Full recomputation keeps only the layer input (fp16): 2·s·b·h, and reruns the whole layer.
    * Context parallelism cp gives each rank s/cp of the tokens: every term above is per token of the rank's own
      (its scores are its s/cp queries against all s keys), so the whole count divides by cp.
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden), ("heads", heads)):
        _require(value >= 1, f"{name} must be >= 1, got {value}")
    _require(tp >= 1, f"tp must be >= 1 (1 = no tensor parallelism), got {tp}")
    _require(cp >= 1, f"cp must be >= 1 (1 = no context parallelism), got {cp}")
    _require_heads_divide(hidden, heads)
    _require(recompute in RECOMPUTE_MODES, f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    sbh = seq_len * micro_batch * hidden / cp  # this rank's tokens
    attention_scores = 5 * heads * seq_len / hidden
    if recompute == "full":
        return 2.0 * sbh
    if recompute == "selective":
        attention_scores = 0.0
    if sequence_parallel:
        return sbh * (34 + attention_scores) / tp
    return sbh * (10 + 24 / tp + attention_scores / tp)


def _divisor_hint(hidden: int, heads: int) -> int:
    """The divisor of ``hidden`` nearest to ``heads``, for error messages."""
    return min((d for d in range(1, hidden + 1) if hidden % d == 0), key=lambda d: abs(d - heads))


def _require_heads_divide(hidden: int, heads: int) -> None:
    """ValueError, with the nearest divisor as a hint (searched only then: it walks every divisor of hidden)."""
    if hidden % heads:
        raise ValueError(f"heads ({heads}) must divide hidden ({hidden}); "
                         f"pick e.g. heads={_divisor_hint(hidden, heads)}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU. ``activations`` is None when the plan has no model shape to compute it from."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: Optional[float] = None

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0)

    def describe(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer_state", self.optimizer_state), ("activations", self.activations),
                ("total", self.total)]
        lines = [f"{'per GPU':<16}{'memory':>12}"]
        for name, value in rows:
            lines.append(f"{name:<16}{'n/a' if value is None else format_bytes(value):>12}")
        return "\n".join(lines)

    __str__ = describe


@dataclass(frozen=True)
class MemoryPlan:
    """A model, a training setup and a parallel layout: everything the estimate needs.

    Give the model either as ``params`` (a count) or as a GPT shape (``n_layer``, ``hidden``,
    ``heads``, ``vocab``, ``seq_len``); with both, ``params`` wins for model states and the shape
    still gives the activations. Ψ per GPU = params / (tp·pp): an even split, which ignores that
    the embedding really sits on the first and last pipeline stages.
    """

    params: Optional[float] = None
    n_layer: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    vocab: int = 0
    seq_len: int = 1024
    micro_batch: int = 1
    precision: str = "mixed"
    dp: int = 1
    zero_stage: int = 0
    tp: int = 1
    pp: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    cp: int = 1  # context parallelism: each rank keeps the activations of seq/cp tokens (dp: the ranks ZeRO shards
    #              over, dp × cp under context parallelism, which average the same parameters' gradients)

    def __post_init__(self):
        has_shape = None not in (self.n_layer, self.hidden, self.heads)
        _require(self.params is not None or has_shape,
                 "give either params=<count> or the GPT shape n_layer, hidden and heads")
        _require(self.params is None or self.params >= 0, f"params must be >= 0, got {self.params}")
        for name in ("n_layer", "hidden", "heads"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        for name in ("seq_len", "micro_batch", "dp", "tp", "pp", "cp"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.vocab >= 0, f"vocab must be >= 0, got {self.vocab}")
        _require(self.precision in PRECISION_BYTES,
                 f"precision must be one of {tuple(PRECISION_BYTES)}, got {self.precision!r}")
        _require(self.zero_stage in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        _require(self.recompute in RECOMPUTE_MODES,
                 f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if has_shape:
            _require_heads_divide(self.hidden, self.heads)
            _require(self.heads % self.tp == 0,
                     f"tp ({self.tp}) must divide heads ({self.heads}): tensor parallelism splits whole heads")

    @property
    def total_params(self) -> float:
        if self.params is not None:
            return self.params
        return gpt_param_count(self.n_layer, self.hidden, self.vocab, self.seq_len)

    @property
    def layers_per_gpu(self) -> Optional[int]:
        """ceil(L / pp): with an uneven split the busiest stage sets the memory you need."""
        return None if self.n_layer is None else math.ceil(self.n_layer / self.pp)


def estimate_memory(plan: MemoryPlan, **changes) -> MemoryBreakdown:
    """Per-GPU training memory of ``plan`` (fields in ``changes`` override it).

    Activations = ceil(L/pp) layers × ``activation_bytes_per_layer``, one micro-batch. Two
    simplifications, both on the low side: the embedding/logits activations are left out, and
    under a 1F1B pipeline schedule the first stage keeps up to pp micro-batches in flight, so its
    peak approaches pp × this number (Korthikanti et al., §4.2.3).
    """
    plan = dataclasses.replace(plan, **changes) if changes else plan
    weight_bytes, grad_bytes, k = PRECISION_BYTES[plan.precision]
    psi = plan.total_params / (plan.tp * plan.pp)
    weights, grads, optimizer = zero_model_state_split(psi, plan.dp, plan.zero_stage, k, weight_bytes, grad_bytes)
    activations = None
    if plan.layers_per_gpu is not None:
        per_layer = activation_bytes_per_layer(plan.seq_len, plan.micro_batch, plan.hidden, plan.heads,
                                               plan.tp, plan.recompute, plan.sequence_parallel, plan.cp)
        activations = plan.layers_per_gpu * per_layer
    return MemoryBreakdown(weights, grads, optimizer, activations)


PRESETS: dict[str, MemoryPlan] = {
    "gpt2-small": MemoryPlan(n_layer=12, hidden=768, heads=12, vocab=50257, seq_len=1024),
    "gpt2-xl": MemoryPlan(n_layer=48, hidden=1600, heads=25, vocab=50257, seq_len=1024),
    # Llama uses rotary positions, so no s·h term; its SwiGLU MLP (3·h·11008) ≈ the 8h² counted.
    "llama2-7b": MemoryPlan(params=gpt_param_count(32, 4096, 32000), n_layer=32, hidden=4096,
                            heads=32, vocab=32000, seq_len=4096),
    "zero-paper-7.5b": MemoryPlan(params=7.5e9),
    # Korthikanti et al.'s 175B GPT-3 shape (s=2048, h=12288, a=96), the paper's running example.
    "gpt3-175b": MemoryPlan(n_layer=96, hidden=12288, heads=96, vocab=51200, seq_len=2048),
}


def preset(name: str) -> MemoryPlan:
    """A well-known model as a ``MemoryPlan``; change the layout with ``estimate_memory(plan, dp=8, ...)``."""
    _require(name in PRESETS, f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
