"""The step-time and memory model: one optimizer step of a layout on a cluster, term by term.

This is a *model*. It is built from exact counts and the α–β network model and has two fitted
constants; :mod:`labkit.sim.validate` reports how far it lands from published runs.

Ranks are ordered tensor-parallel fastest, then data-parallel, then pipeline (Megatron-LM's order):
a TP group of ``tp`` neighbours sits inside a node when tp ≤ GPUs per node; DP and PP groups cross
nodes once their span (stride × size) exceeds a node, and then run at the inter-node link's speed.
Each rank of a replica does 1/(tp·pp) of the replica's FLOPs (the embedding and logits are spread
evenly over the stages, a small simplification). For one micro-batch on one rank:

* **compute** = model FLOPs / (MATMUL_EFFICIENCY · peak); forward is 1/3 of it, backward 2/3
  (labkit's count, 6N + 12·L·d·T per token, :func:`labkit.model.flops.flops_per_token`).
* **recompute** = the extra forward: full recompute reruns each block's forward
  (2·N_blocks + 4·L·d·T per token), selective only the attention core (4·L·d·T).
* **tp comm** = per layer, 4 all-reduces of micro_batch·seq·hidden activations (2 forward, 2
  backward; 2 more under full recompute). Sequence parallelism turns each into an all-gather plus a
  reduce-scatter: the same ring bytes. Not overlapped (Megatron-LM 2019–2022 did not).
* **pp comm** = one activation sent forward and one gradient back per micro-batch and model chunk,
  each TP rank sending only its 1/tp slice (Megatron-LM's scatter/gather optimisation, Narayanan et al.
  2021 §4.1, on by default; with sequence parallelism the activations are split anyway).

Every collective costs ``rounds·α + bytes/(NETWORK_EFFICIENCY·β)`` with rounds and bytes from
:func:`labkit.comm.network.collective_cost` (ring) on the group's link. A replica's busy time is
m × (the above); the **bubble** adds (p − 1)/(v·m) of it — so that bubble / (busy + bubble) is
:func:`labkit.parallel.pipeline.ideal_bubble` (p − 1)/(m + p − 1) for v = 1 (v: interleaved chunks).

**dp comm**: ZeRO 0–2 move the gradients once per step (an all-reduce; ZeRO-1/2's reduce-scatter +
all-gather has the same ring bytes); with ``overlap_dp`` it hides under the last micro-batch's
backward and only the rest is exposed. ZeRO-3 (FSDP) gathers the weights before each forward and each
backward and reduce-scatters the gradients, every micro-batch: forward gathers hide under the forward,
the rest under the backward (recompute included), the excess is exposed. A layer's recompute runs just
before its backward, inside the same gather (DeepSpeed's and FSDP's pre-backward fetch), so recompute
adds no gather.

Step time = compute + recompute + tp comm + pp comm + bubble + dp exposed. The optimizer update
(memory-bound, a few ms), memory-bound elementwise kernels beyond what MATMUL_EFFICIENCY absorbs, and
data loading are left out; so are hierarchical (node-aware) collectives: a group that crosses nodes runs
at the inter-node link's per-GPU share.

**Memory per GPU** is :func:`labkit.memory_estimate.estimate_memory` for the same layout (labkit's
parameter count split evenly over tp·pp, ZeRO's sharding over dp, ceil(L/pp) layers of Korthikanti et
al.'s activation bytes), with the activations times the micro-batches the first stage holds in flight
(:func:`in_flight`). ZeRO-3's gathered working layer and the logits' activations are not counted.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Optional

from labkit.comm.network import Cost, collective_cost
from labkit.memory_estimate import MemoryPlan, estimate_memory
from labkit.sim.cluster import Cluster, Link

# The model's two constants, fitted once to all the published points together by
# labkit.sim.validate.fit_constants (the pair, on a 0.01 grid, that minimises the worst error in units of
# each table's bar); never tuned per point. tests/sim/test_validate.py checks that the fit still gives them.
MATMUL_EFFICIENCY = 0.62  # achieved fraction of the dense peak (fitted on the A100 runs)
NETWORK_EFFICIENCY = 0.52  # achieved fraction of a link's catalog bandwidth, every level

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per activation / gradient element on the wire


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: hidden size, layers, heads, sequence length, vocabulary (learned positions, no biases)."""
    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int

    @classmethod
    def from_gpt(cls, shape) -> "ModelShape":
        """From a :class:`labkit.model.gpt.GPTShape` (or anything with its field names)."""
        return cls(shape.n_embd, shape.n_layer, shape.n_head, shape.block_size, shape.vocab_size)

    def gpt_fields(self) -> SimpleNamespace:
        """The GPTShape fields labkit's FLOP count reads (no torch needed)."""
        return SimpleNamespace(n_embd=self.hidden, n_layer=self.layers, n_head=self.heads,
                               block_size=self.seq, vocab_size=self.vocab, bias=False)


@dataclass(frozen=True)
class Layout:
    """How a step is spread: dp·tp·pp GPUs, ``micro_batches`` of ``micro_batch`` sequences per replica."""
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

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "micro_batch", "micro_batches", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.micro_batches


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per step on the busiest rank, each term separately, and bytes per GPU."""
    compute: float
    recompute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm_hidden: float
    dp_comm_exposed: float
    model_flops: float  # per step, whole job (labkit's count, no recompute)
    gpus: int
    peak_flops: float  # per GPU
    memory_parameters: float
    memory_gradients: float
    memory_optimizer: float
    memory_activations: float
    gpu_memory: float

    @property
    def total(self) -> float:
        """The step time: every term except the DP communication hidden under backward."""
        return (self.compute + self.recompute + self.tp_comm + self.pp_comm + self.bubble
                + self.dp_comm_exposed)

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
        terms = [("compute", self.compute), ("recompute", self.recompute), ("tp comm", self.tp_comm),
                 ("pp comm", self.pp_comm), ("bubble", self.bubble), ("dp comm exposed", self.dp_comm_exposed)]
        lines = ["step time (a model)"]
        lines += [f"  {name:<18}{seconds * 1e3:>12.2f} ms {100 * seconds / self.total:>6.1f}%" for name, seconds in terms]
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


def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token, labkit's exact count (6N + 12·L·d·T)."""
    from labkit.model import flops  # lazy: it imports torch through labkit.model.gpt

    return flops.flops_per_token(shape.gpt_fields())


def block_params(shape: ModelShape) -> int:
    """Parameters of all transformer blocks (labkit's count): the matmuls recomputation reruns."""
    from labkit.model import flops

    return shape.layers * flops.count_params(shape.gpt_fields())["per_block"]


def recompute_flops_per_token(shape: ModelShape, recompute: str) -> float:
    """Extra forward FLOPs per token: the blocks' forward (full), the attention core's (selective)."""
    attention_core = 4.0 * shape.layers * shape.hidden * shape.seq  # QKᵀ and A·V, forward
    if recompute == "full":
        return 2.0 * block_params(shape) + attention_core
    return attention_core if recompute == "selective" else 0.0


def collective_seconds(op: str, nbytes: float, world: int, link: Link | None,
                       efficiency: Optional[float] = None) -> float:
    """α·rounds + bytes/(efficiency·β) of a ring ``op`` on ``link`` (0 for a group of one)."""
    if link is None or world <= 1:
        return 0.0
    efficiency = NETWORK_EFFICIENCY if efficiency is None else efficiency
    cost: Cost = collective_cost(op, nbytes, world, "ring")
    return cost.rounds * link.latency + cost.bytes / (efficiency * link.bandwidth)


def step_time(shape: ModelShape, layout: Layout, cluster: Cluster, precision: str = "bf16",
              matmul_efficiency: Optional[float] = None, network_efficiency: Optional[float] = None) -> StepBreakdown:
    """Predicted time of one step and memory per GPU of ``layout`` for ``shape`` on ``cluster``."""
    eff = MATMUL_EFFICIENCY if matmul_efficiency is None else matmul_efficiency
    net = NETWORK_EFFICIENCY if network_efficiency is None else network_efficiency
    lay, p, m, v = layout, layout.pp, layout.micro_batches, layout.chunks
    if lay.gpus > cluster.gpus:
        raise ValueError(f"layout needs {lay.gpus} GPUs, {cluster.name} has {cluster.gpus}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    elem = PRECISIONS[precision]
    peak = cluster.gpu.peak_flops(precision)
    rate = eff * peak
    split = lay.tp * lay.pp
    tokens = lay.micro_batch * shape.seq  # per micro-batch
    layers_per_stage = math.ceil(shape.layers / p)

    # compute and recompute, per micro-batch on one rank
    model_fl = flops_per_token(shape) * tokens / split
    forward, backward = model_fl / 3 / rate, 2 * model_fl / 3 / rate
    recompute = recompute_flops_per_token(shape, lay.recompute) * tokens / split / rate

    # tensor parallel: activations all-reduced inside the TP group
    tp_link = cluster.link_for(1, lay.tp)
    act_bytes = tokens * shape.hidden * elem
    n_tp = 4 + (2 if lay.recompute == "full" else 0)
    tp_comm = layers_per_stage * n_tp * collective_seconds("all_reduce", act_bytes, lay.tp, tp_link, net)

    # pipeline: one send forward, one back, per micro-batch and chunk
    pp_link = cluster.link_for(lay.tp * lay.dp, p)
    send_bytes = act_bytes / (lay.tp if lay.sequence_parallel or lay.pp_scatter_gather else 1)
    pp_comm = 2 * v * collective_seconds("send", send_bytes, p, pp_link, net)

    busy = m * (forward + backward + recompute + tp_comm + pp_comm)
    bubble = busy * (p - 1) / (v * m)

    # data parallel: gradients (ZeRO 0-2) or weights and gradients (ZeRO-3), over the DP group
    dp_link = cluster.link_for(lay.tp, lay.dp)
    params_rank = flops_params(shape) / split
    wbytes = params_rank * elem
    if lay.zero < 3:
        dp_total = collective_seconds("all_reduce", wbytes, lay.dp, dp_link, net)
        window = (backward + recompute) if lay.overlap_dp else 0.0
        hidden = min(dp_total, window)
    else:
        gather = collective_seconds("all_gather", wbytes, lay.dp, dp_link, net)
        scatter = collective_seconds("reduce_scatter", wbytes, lay.dp, dp_link, net)
        fwd_comm = gather
        bwd_comm = gather + scatter  # the recompute reuses the backward's gather
        if lay.overlap_dp:
            hidden_mb = min(fwd_comm, forward) + min(bwd_comm, backward + recompute)
        else:
            hidden_mb = 0.0
        dp_total, hidden = m * (fwd_comm + bwd_comm), m * hidden_mb
    memory = rank_memory(shape, lay, precision)
    return StepBreakdown(
        compute=m * (forward + backward), recompute=m * recompute, tp_comm=m * tp_comm, pp_comm=m * pp_comm,
        bubble=bubble, dp_comm_hidden=hidden, dp_comm_exposed=dp_total - hidden,
        model_flops=flops_per_token(shape) * tokens * m * lay.dp, gpus=lay.gpus, peak_flops=peak,
        memory_parameters=memory["parameters"], memory_gradients=memory["gradients"],
        memory_optimizer=memory["optimizer"], memory_activations=memory["activations"],
        gpu_memory=cluster.gpu.memory_bytes)


def flops_params(shape: ModelShape) -> int:
    """Parameters taking part in matmuls (labkit's count: all but the position embedding)."""
    from labkit.model import flops

    return flops.count_params(shape.gpt_fields())["flops_params"]


def in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first stage holds at once: m (GPipe), min(p, m) (1F1B).
    Interleaving keeps a little more (Narayanan et al. 2021, §2.2.2); it is counted as 1F1B here."""
    if layout.pp == 1:
        return 1
    return layout.micro_batches if layout.schedule == "gpipe" else min(layout.pp, layout.micro_batches)


def rank_memory(shape: ModelShape, layout: Layout, precision: str = "bf16") -> dict:
    """Bytes per GPU: :func:`labkit.memory_estimate.estimate_memory` for the same layout (an even split
    of labkit's parameter count over tp·pp, ZeRO sharding over dp, ceil(L/pp) layers of activations),
    with the activations times the micro-batches the first stage holds in flight."""
    from labkit.model import flops

    plan = MemoryPlan(params=flops.count_params(shape.gpt_fields())["total"], n_layer=shape.layers,
                      hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab, seq_len=shape.seq,
                      micro_batch=layout.micro_batch, precision="fp32" if precision == "fp32" else "mixed",
                      dp=layout.dp, zero_stage=layout.zero, tp=layout.tp, pp=layout.pp,
                      recompute=layout.recompute, sequence_parallel=layout.sequence_parallel)
    est = estimate_memory(plan)
    return {"parameters": est.parameters, "gradients": est.gradients, "optimizer": est.optimizer_state,
            "activations": est.activations * in_flight(layout)}

