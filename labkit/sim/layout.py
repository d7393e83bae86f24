"""The step model's vocabulary: a model's shape, a layout (how one step is spread over GPUs) and the breakdown
of a modelled step into its terms. Data only; :mod:`labkit.sim.step` computes the breakdown.

Every option a layout takes is written once, here (``SCHEDULES``, ``RECOMPUTE``, ``ATTENTION``, ``PRECISIONS``);
widgets and planners read them from this module. Context parallelism's variants and chunkings are the trainer's
(``parallel.cp.impl``, ``parallel.cp.layout``: :data:`labkit.parallel.spec.CP_IMPLS`, ``CP_LAYOUTS``), checked by
:func:`labkit.sim.context.cp_problems` when a step is modelled (importing them here would import torch).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per activation / gradient element on the wire
ATTENTION = ("naive", "flash")  # the s × s scores written to memory (Megatron-LM to 2022), or never (FlashAttention)
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's bucket_cap_mb=25


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: hidden size, layers, heads, sequence length, vocabulary (learned positions, no biases); with
    ``experts`` > 0 every ``moe_every``-th block's MLP is a mixture of that many experts, each token through
    ``top_k`` (:mod:`labkit.sim.experts`)."""
    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1

    @classmethod
    def from_gpt(cls, shape) -> "ModelShape":
        """From a :class:`labkit.model.gpt.GPTShape` (or anything with its field names)."""
        moe = getattr(shape, "moe", None)
        experts = (moe.experts, moe.top_k, moe.every) if moe is not None else ()
        return cls(shape.n_embd, shape.n_layer, shape.n_head, shape.block_size, shape.vocab_size, *experts)

    def gpt_fields(self) -> SimpleNamespace:
        """The GPTShape fields labkit's FLOP count reads (no torch needed)."""
        moe = SimpleNamespace(experts=self.experts, top_k=self.top_k, every=self.moe_every, shared_expert=False,
                              replaces=lambda layer: (layer + 1) % self.moe_every == 0,
                              layers=lambda n_layer: n_layer // self.moe_every) if self.experts > 0 else None
        return SimpleNamespace(n_embd=self.hidden, n_layer=self.layers, n_head=self.heads,
                               block_size=self.seq, vocab_size=self.vocab, bias=False, moe=moe)


@dataclass(frozen=True)
class Layout:
    """How a step is spread: dp·pp·cp·tp GPUs, ``micro_batches`` of ``micro_batch`` sequences per replica (a replica:
    pp·cp·tp GPUs; cp splits each sequence, so it adds GPUs but no sequences)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per stage for the interleaved schedule (v)
    zero: int = 0  # ZeRO stage 0-3; 3 is FSDP
    recompute: str = "none"
    sequence_parallel: bool = False
    overlap_dp: bool = True
    pp_scatter_gather: bool = True  # TP ranks send 1/tp of each activation between stages
    attention: str = "naive"  # "flash": FlashAttention, the scores never written to memory
    bucket_bytes: float = DDP_BUCKET_BYTES  # ZeRO 0-2: the gradients go in all-reduces of this size
    grad_compression: float = 1.0  # the DP gradient bytes on the wire are divided by this (a compressor's ratio)
    sync_every: int = 1  # H > 1: replicas averaged every H steps after the optimizer (local SGD), not overlapped
    cp: int = 1  # context parallelism: each sequence cut over cp GPUs (labkit.sim.context)
    cp_impl: str = "ring"  # parallel.cp.impl: ring, allgather or ulysses
    cp_layout: str = "head_tail"  # parallel.cp.layout: head_tail (balanced causal work) or contiguous
    ep: int = 1  # expert parallelism: the experts spread over ep of the dp ranks (labkit.sim.experts)
    expert_imbalance: float = 1.0  # max/mean rows per ep rank (1: perfect balance; labkit.sim.experts.rank_imbalance)

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "micro_batches", "chunks", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grad_compression < 1 or self.bucket_bytes <= 0:
            raise ValueError(f"grad_compression must be >= 1 and bucket_bytes > 0, got "
                             f"{self.grad_compression!r}, {self.bucket_bytes!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.sync_every > 1 and self.zero == 3:
            raise ValueError("sync_every > 1 (local SGD) keeps a whole replica per rank: not with ZeRO-3")
        if self.sync_every > 1 and self.tp * self.pp * self.cp > 1:  # the trainer's refusal (parallel.dp.local_sgd)
            raise ValueError("sync_every > 1 (local SGD) averages whole models: replicas that drift apart between "
                             "synchronisations are whole models, not with tp, pp or cp")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError("chunks > 1 needs schedule='interleaved'")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def gradient_ranks(self) -> int:
        """The ranks that hold the same parameters and average their gradients: dp × cp (the trainer's dp_cp axis,
        :data:`labkit.parallel.mesh.GRADIENT_AXIS`; Megatron-LM's data-parallel group with cp)."""
        return self.dp * self.cp

    @property
    def axes(self) -> str:
        """``dp 128 × tp 1 × pp 1``, and ``× cp 4 (ring, head_tail)`` when the layout cuts its sequences (what the
        reports print)."""
        return f"dp {self.dp} × tp {self.tp} × pp {self.pp}" + (
            f" × cp {self.cp} ({self.cp_impl}, {self.cp_layout})" if self.cp > 1 else "") + (
            f" (ep {self.ep})" if self.ep > 1 else "")

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.micro_batches


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per step on the busiest rank, each term separately, and bytes per GPU."""
    compute: float
    recompute: float
    attention_memory: float
    elementwise_memory: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm_hidden: float
    dp_comm_exposed: float
    overlap_slowdown: float
    model_flops: float  # per step, whole job (labkit's count, no recompute)
    gpus: int
    peak_flops: float  # per GPU
    memory_parameters: float
    memory_gradients: float
    memory_optimizer: float
    memory_activations: float
    gpu_memory: float
    cp_comm: float = 0.0  # context parallelism's collectives (last, so that a breakdown made before cp still builds)
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (labkit.sim.experts)
    expert_imbalance: float = 0.0  # the busiest rank's experts' extra compute (max/mean load > 1)

    # The terms that add up to the step time, with their labels (widgets and text read them from here).
    TIME_TERMS = (("compute", "compute"), ("recompute", "recompute"), ("attention_memory", "attention memory"),
                  ("elementwise_memory", "elementwise memory"),
                  ("tp_comm", "tp comm"), ("cp_comm", "cp comm"), ("ep_comm", "ep comm"), ("pp_comm", "pp comm"),
                  ("expert_imbalance", "expert imbalance"), ("bubble", "bubble"),
                  ("dp_comm_exposed", "dp comm exposed"), ("overlap_slowdown", "overlap slowdown"))

    @property
    def total(self) -> float:
        """The step time: every term except the DP communication hidden under backward."""
        return sum(getattr(self, name) for name, _ in self.TIME_TERMS)

    @property
    def memory_total(self) -> float:
        return self.memory_parameters + self.memory_gradients + self.memory_optimizer + self.memory_activations

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.gpu_memory

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU."""
        return self.model_flops / self.total / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.gpus / self.peak_flops

    def describe(self) -> str:
        """The breakdown as plain text: each time term with its share of the step, then memory."""
        terms = [(label, getattr(self, name)) for name, label in self.TIME_TERMS]
        lines = ["step time (a model)"]
        lines += [f"  {name:<18}{seconds * 1e3:>12.2f} ms {100 * seconds / self.total:>6.1f}%"
                  for name, seconds in terms]
        lines += [f"  {'(dp comm hidden)':<18}{self.dp_comm_hidden * 1e3:>12.2f} ms",
                  f"  {'total':<18}{self.total * 1e3:>12.2f} ms   MFU {100 * self.mfu:.1f}%",
                  "memory per GPU"]
        memory = [("parameters", self.memory_parameters), ("gradients", self.memory_gradients),
                  ("optimizer", self.memory_optimizer), ("activations", self.memory_activations),
                  ("total", self.memory_total)]
        lines += [f"  {name:<18}{value / 1e9:>12.2f} GB" for name, value in memory]
        lines.append(f"  {'fits' if self.fits else 'does NOT fit'} in {self.gpu_memory / 1e9:.0f} GB")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "memory_total": self.memory_total, "mfu": self.mfu}
