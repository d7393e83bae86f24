"""A budget in GPU-hours turned into a model, a layout and a wall clock — every number *modelled*.

Three steps, each from a module that already does it:

1. **FLOPs → (N, D).** Chinchilla's compute-optimal split of a FLOP budget C = 6·N·D
   (:func:`labkit.scaling.planner.plan`, Hoffmann et al. 2022's approach-3 law by default).
2. **N → a shape.** A GPT of about N parameters (:func:`shape_for`): ``n_layer`` = L and d_model ≈ 128·L,
   the aspect GPT-3's larger models keep (6.7B: 4096/32, 13B: 5140/40, 175B: 12288/96; Brown et al. 2020,
   Table 2.1; Kaplan et al. 2020 §3 found the loss barely depends on the aspect over a wide range, so the
   rule is a convention, not an optimum), rounded to a multiple of 1,024 so that heads of 128 come in
   multiples of 8 and tensor parallelism up to 8 divides them. L is the one whose parameter count (labkit's,
   :func:`labkit.model.flops.count_params`) is nearest N on a log scale. Sequence 2,048 and a vocabulary of
   51,200 (GPT-2's 50,257 padded, as Megatron-LM does), as the published shapes in :mod:`labkit.sim.validate`.
3. **shape → the fastest layout.** Every layout of the cluster's GPUs (:func:`layouts`: tp a power of two up
   to a node dividing the heads, pp a divisor of the rest up to the layers, dp the rest, a micro-batch that
   divides the global batch, ZeRO 0–3 — 0–1 with pipelining, as DeepSpeed's pipeline engine allows — and
   each recompute policy; 1F1B, sequence parallelism with tp, FlashAttention) through the step model; the
   fastest that fits in memory wins.

**The loop.** GPU-hours become FLOPs only through the FLOP/s the job achieves — and that depends on the
model, which depends on the FLOPs. So: guess the rate (the model's ceiling, matmul efficiency × peak), get
C, N, the shape, its fastest layout and *its* rate; repeat until the shape stops changing (a fixed point:
same shape, same rate, same C). The rate counts 6·N FLOPs per token, the convention of C = 6·N·D; then the
tokens the hours buy for this shape are D = C / 6N, and the wall clock 6·N·D / (the job's FLOP/s) is the
budget over the GPUs, as it must be. The global batch is a setting: :data:`GLOBAL_BATCH_TOKENS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.scaling.allocation import CHINCHILLA_PUBLISHED
from labkit.scaling.planner import TrainingChoice, plan
from labkit.sim import step as step_model
from labkit.sim.cluster import Cluster, cluster
from labkit.sim.scenario import LABEL
from labkit.sim.step import RECOMPUTE, Layout, ModelShape, StepBreakdown, step_time, total_params
from labkit.text import wrap

ASPECT = 128  # d_model / n_layer of GPT-3 6.7B–175B (Brown et al. 2020, Table 2.1)
HEAD_DIM = 128  # GPT-3 175B's heads
WIDTH_STEP = 1024  # d_model a multiple of this: heads = d / 128 in multiples of 8
SEQ, VOCAB = 2048, 51200
GLOBAL_BATCH_TOKENS = 2 ** 21  # ≈ 2M tokens per step: GPT-3 6.7B and 13B's batch (Brown et al. 2020, Table 2.1)
MAX_MICRO_BATCH = 16
SECONDS_PER_HOUR = 3600.0


@dataclass
class BudgetPlan:
    """What the budget buys: Chinchilla's choice, the shape, its fastest layout and the clock. All modelled."""
    gpu_hours: float
    cluster: Cluster
    precision: str
    chinchilla: TrainingChoice  # N_opt and D_opt for the final C (the planner's compute-optimal choice)
    shape: ModelShape
    n_params: int  # the shape's (labkit's count), near N_opt
    layout: Layout
    step: StepBreakdown
    layouts_tried: int
    iterations: list = field(default_factory=list)  # one dict per pass of the fixed point
    converged: bool = True
    label: str = LABEL

    @property
    def flops(self) -> float:
        return self.chinchilla.flops

    @property
    def tokens(self) -> float:
        """The tokens the budget buys for this shape: C / 6N."""
        return self.flops / (6 * self.n_params)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.global_batch * self.shape.seq / self.step.total

    @property
    def flops_per_s_per_gpu(self) -> float:
        """Achieved FLOP/s per GPU counted as 6N per token (C = 6ND's convention; ``step.mfu`` counts attention too)."""
        return 6 * self.n_params * self.tokens_per_s / self.layout.gpus

    @property
    def wall_s(self) -> float:
        """6·N·D / the job's FLOP/s."""
        return 6 * self.n_params * self.tokens / (self.flops_per_s_per_gpu * self.layout.gpus)

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / (self.layout.global_batch * self.shape.seq))


# ---------------------------------------------------------------- N → shape

def shape_of(layers: int, seq: int = SEQ, vocab: int = VOCAB) -> ModelShape:
    """L layers, d_model = 128·L rounded to a multiple of 1,024 (at least 1,024), heads of 128."""
    hidden = WIDTH_STEP * max(1, math.floor(ASPECT * layers / WIDTH_STEP + 0.5))
    return ModelShape(hidden, layers, hidden // HEAD_DIM, seq, vocab)


def shape_for(target_params: float, seq: int = SEQ, vocab: int = VOCAB) -> ModelShape:
    """The shape of the rule whose parameter count is nearest ``target_params`` (on a log scale)."""
    if target_params < total_params(shape_of(1, seq, vocab)):
        raise ValueError(f"{target_params:.3g} parameters is below the rule's smallest model "
                         f"({total_params(shape_of(1, seq, vocab)):.3g}, mostly its embedding): "
                         f"a larger budget, please")
    layers = 1
    while total_params(shape_of(layers + 1, seq, vocab)) < target_params:
        layers += 1
    return min((shape_of(layers, seq, vocab), shape_of(layers + 1, seq, vocab)),
               key=lambda s: abs(math.log(total_params(s) / target_params)))


# ---------------------------------------------------------------- shape → the fastest layout

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, c: Cluster, global_batch: int, quick: bool = False):
    """Every layout of all ``c``'s GPUs the search tries (see the module docstring); ``quick``: selective
    recompute and ZeRO-1 only."""
    recomputes, zeros = (("selective",), (1,)) if quick else (RECOMPUTE, (0, 1, 2, 3))
    for tp in (t for t in divisors(c.gpus_per_node) if t & (t - 1) == 0 and shape.heads % t == 0 and c.gpus % t == 0):
        for pp in (p for p in divisors(c.gpus // tp) if p <= shape.layers):
            dp = c.gpus // (tp * pp)
            if global_batch % dp:
                continue
            for micro in (b for b in divisors(global_batch // dp) if b <= MAX_MICRO_BATCH):
                for zero in (z for z in zeros if pp == 1 or z <= 1):
                    for recompute in recomputes:
                        yield Layout(dp=dp, tp=tp, pp=pp, micro_batch=micro, micro_batches=global_batch // (dp * micro),
                                     zero=zero, recompute=recompute, sequence_parallel=tp > 1, attention="flash")


def fastest_layout(shape: ModelShape, c: Cluster, global_batch: int, precision: str = "bf16",
                   quick: bool = False) -> tuple[Layout, StepBreakdown, int]:
    """The layout with the shortest modelled step among those that fit; (layout, its step, layouts tried)."""
    best, tried = None, 0
    for layout in layouts(shape, c, global_batch, quick):
        tried += 1
        s = step_time(shape, layout, c, precision)
        if s.fits and (best is None or s.total < best[1].total):
            best = (layout, s)
    if best is None:
        raise ValueError(f"no layout of {shape} fits on {c.gpus} GPUs of {c.name} at a global batch of "
                         f"{global_batch}: more GPUs, or a smaller budget")
    return best[0], best[1], tried


# ---------------------------------------------------------------- the fixed point

def plan_budget(gpu_hours: float, cluster_name: str = "dgx-h100", gpus: int = 256, precision: str = "bf16",
                global_batch_tokens: int = GLOBAL_BATCH_TOKENS, fit=CHINCHILLA_PUBLISHED, max_iterations: int = 10,
                quick: bool = False) -> BudgetPlan:
    """Chinchilla's model for ``gpu_hours`` on ``gpus`` GPUs of ``cluster_name``, its layout and wall clock."""
    c = cluster(cluster_name, gpus)
    batch = max(1, global_batch_tokens // SEQ)
    rate = step_model.gpu_matmul_efficiency(c.gpu) * c.gpu.peak_flops(precision)  # first guess: the model's ceiling
    iterations, shapes = [], []
    while True:
        chosen = plan(budget_hours=gpu_hours / c.gpus, flops_per_second=rate * c.gpus, fit=fit,
                      neighbours=()).recommended
        shape = shape_for(chosen.n_params)
        layout, s, tried = fastest_layout(shape, c, batch, precision, quick)
        result = BudgetPlan(gpu_hours, c, precision, chosen, shape, total_params(shape), layout, s, tried, iterations)
        iterations.append({"rate_per_gpu": rate, "flops": chosen.flops, "n_opt": chosen.n_params,
                           "shape": shape, "n_params": result.n_params})
        if shapes and shape == shapes[-1]:
            return result  # same shape, same rate: the fixed point
        if shape in shapes or len(iterations) >= max_iterations:
            result.converged = False  # the rounding of N to a shape cycles: keep the last
            return result
        shapes.append(shape)
        rate = result.flops_per_s_per_gpu


# ---------------------------------------------------------------- text

def _si(x: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def describe_layout(lay: Layout) -> str:
    return (f"{lay.axes}, micro-batch {lay.micro_batch} × {lay.micro_batches}, "
            f"ZeRO-{lay.zero}, recompute {lay.recompute}" + (", sequence parallel" if lay.sequence_parallel else "")
            + f", {lay.attention} attention")


def format_plan(p: BudgetPlan) -> str:
    """The plan as plain text: the fixed point's passes, Chinchilla's choice, the shape, the layout, the clock."""
    c, s, sh = p.cluster, p.step, p.shape
    lines = [f"A budget turned into a training plan — {p.label}",
             f"budget {p.gpu_hours:,.0f} GPU-hours on {c.name}, {c.gpus:,} GPUs, {p.precision}; global batch "
             f"{p.layout.global_batch:,} × {sh.seq:,} tokens (a setting)", "",
             "the FLOP/s the job achieves sets the FLOPs the hours buy; repeated until the shape stops changing",
             "(pass 0 guesses the matmul efficiency × the peak):",
             f"  {'pass':>4} {'FLOP/s per GPU (6N)':>20} {'C (FLOPs)':>10} {'N_opt':>7} {'shape':>22}"]
    for i, it in enumerate(p.iterations):
        guess = "  (a guess)" if i == 0 else ""
        lines.append(f"  {i:>4} {it['rate_per_gpu'] / 1e12:>16.0f} T/s {it['flops']:>10.2e} {_si(it['n_opt']):>7} "
                     f"{it['shape'].hidden:>6} × {it['shape'].layers:>3} layers{guess}")
    if not p.converged:
        lines.append("  (no fixed point: rounding N to a shape cycles; the last pass is kept)")
    ch = p.chinchilla
    lines += ["", f"Chinchilla (approach 3): C = {ch.flops:.2e} FLOPs → N_opt {_si(ch.n_params)}, D_opt "
                  f"{_si(ch.tokens)} tokens, predicted loss {ch.predicted_loss:.3f}",
              f"shape: h {sh.hidden} × {sh.layers} layers × {sh.heads} heads, seq {sh.seq}, vocab {sh.vocab}: "
              f"{_si(p.n_params)} parameters; it trains on C / 6N = {_si(p.tokens)} tokens in {p.steps:,} steps",
              f"layout (fastest that fits, of {p.layouts_tried:,} tried): {describe_layout(p.layout)}",
              f"  step {s.total:.2f} s, {_si(p.tokens_per_s)} tokens/s, {p.flops_per_s_per_gpu / 1e12:.0f} TFLOP/s per "
              f"GPU at 6N per token (MFU {100 * s.mfu:.1f}% by labkit's count, attention included)",
              f"  memory per GPU {s.memory_total / 1e9:.1f} of {s.gpu_memory / 1e9:.0f} GB",
              f"wall clock = 6·N·D / job FLOP/s = {p.wall_s / SECONDS_PER_HOUR:,.1f} h = "
              f"{p.wall_s / 86_400:.1f} days (= {p.gpu_hours:,.0f} GPU-hours / {p.layout.gpus:,} GPUs)"]
    return wrap("\n".join(lines), indent="    ")


def budget_text(gpu_hours: float = 100_000, cluster_name: str = "dgx-h100", gpus: int = 1024,
                quick: bool = False) -> str:
    """:func:`plan_budget` as text (``quick``: selective recompute and ZeRO-1 only in the layout search)."""
    return format_plan(plan_budget(gpu_hours, cluster_name, gpus, quick=quick))
