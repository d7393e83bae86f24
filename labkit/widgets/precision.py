"""Notebook 06's pictures: number formats, fp32 against bf16 on real runs, and the fp16 loss scaler.

``compare_precisions`` trains the same configuration (same seed, same data order) once per precision,
one run after the other so they do not share the cores, and returns each run's loss curve and summary.
What it trains is planned from a measurement first (:func:`plan_comparison`): bf16 speeds a run up only where
the machine multiplies bf16 natively, and where it does not, bf16 trains fewer steps and the lab says why.
The figures and the verdict are pure functions of what the runs returned, tested without a kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.config import Config, resolve_device
from labkit.distributed import threads_per_proc
from labkit.experiments import sweep
from labkit.hardware import BF16_WORTH_IT, bf16_choice, bf16_speed, detect
from labkit.metrics.steps import WARMUP_SKIP
from labkit.plots import FIGURE_WIDTH, label_axes
from labkit.precision import comparison_rows
from labkit.text import wrap

COLORS = {"fp32": "C0", "bf16": "C1", "fp16": "C2", "fp8": "C3"}
MIN_STEPS = 4  # the fewest steps a shortened run trains: its throughput is still a mean past its warm-up step
NOISE_SIGMAS = 2  # a difference in throughput is real beyond this many standard errors of the step-to-step noise


@dataclass
class ComparisonPlan:
    """What the fp32-against-bf16 comparison trains here, and why: ``steps`` per precision, the ``speed`` measured
    (:func:`labkit.hardware.bf16_speed`; None on a GPU, whose tensor cores are a datasheet fact) and ``why``."""
    steps: dict[str, int]
    speed: Optional[dict]
    why: str


def bf16_here(config: Config, nproc: int, speed: Optional[dict] = None, native: Optional[list] = None
              ) -> tuple[str, str, Optional[dict]]:
    """("bf16" or "fp32", why, the measurement) for runs of ``config`` on ``nproc`` workers: on a GPU its tensor cores;
    on a CPU bf16 against fp32 matmuls at the workers' thread count (``speed``, measured when None), explained by the
    CPU's ``native`` bf16 flags (read when None)."""
    if resolve_device(config) == "cuda":
        return "bf16", "On a GPU bf16 runs on the tensor cores", None
    speed = speed or bf16_speed(threads_per_proc(config, nproc))
    return (*bf16_choice(speed, detect()["bf16_flags"] if native is None else native), speed)


def plan_comparison(config: Config, nproc: int, speed: Optional[dict] = None, native: Optional[list] = None
                    ) -> ComparisonPlan:
    """fp32 and bf16 for ``config.run.steps`` each where bf16 is not slower here; otherwise bf16 trains only as many
    steps as fp32's run would time (at least :data:`MIN_STEPS`): enough to lay its loss curve beside fp32's and to
    measure its throughput, without a long wait for an answer the measurement already gave (:func:`bf16_here`)."""
    steps = config.run.steps
    choice, why, speed = bf16_here(config, nproc, speed, native)
    if speed is None or speed["speedup"] >= 1 / BF16_WORTH_IT:
        return ComparisonPlan({"fp32": steps, "bf16": steps}, speed,
                              wrap(f"{why}.\nBoth precisions train {steps} steps; recommend() picks {choice} here."))
    short = min(steps, max(MIN_STEPS, math.ceil(steps * speed["speedup"])))
    return ComparisonPlan({"fp32": steps, "bf16": short}, speed,
                          wrap(f"{why}.\nSo bf16 trains {short} of the {steps} steps: enough to lay its loss curve "
                               f"beside fp32's and measure its throughput. Where bf16 is native, it trains all "
                               f"{steps}; recommend() picks {choice} here."))


def compare_precisions(config: Config, modes=("fp32", "bf16"), nproc: int = 2,
                       steps: Optional[dict[str, int]] = None) -> dict[str, dict]:
    """One real run per precision mode, in turn (``steps[mode]`` steps, else the config's);
    ``{mode: {"steps", "losses", "tokens_per_s", "summary", "run_dir"}}``."""
    points = [(mode, {"precision.mode": mode, "run.name": f"{config.run.name}-{mode}",
                      **({"run.steps": steps[mode]} if steps and mode in steps else {})}) for mode in modes]
    return dict(zip(modes, sweep(config, nproc, points, loss_curve)))


def loss_curve(run, *_) -> dict:
    """What the comparison draws of one finished run: its loss and throughput per step, its summary, where it lives."""
    metrics = run.metrics
    return {"steps": metrics["step"], "losses": metrics["loss"], "tokens_per_s": metrics["tokens_per_s"],
            "summary": run.summary, "run_dir": run.run_dir}


def step_noise(per_step: list) -> float:
    """The relative standard error of a run's mean tokens/s, from its steps past the warm-up (0 when too few)."""
    values = [v for v in per_step[min(WARMUP_SKIP, len(per_step) // 4):] if v is not None]
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return spread / mean / math.sqrt(len(values))


def _speed_line(ratio: float, band: float, plan: ComparisonPlan) -> str:
    speed = plan.speed
    matmuls = speed["speedup"] if speed else None
    if ratio > 1 + band:
        line = f"bf16 trained ×{ratio:.2f} as fast as fp32 (the step-to-step noise is ±{band:.0%})"
        if matmuls and ratio < matmuls:
            line += (f"; its matmuls alone measured ×{matmuls:#.2g}, and the rest of the step (autocast's casts, "
                     "norms and softmax in fp32, the optimizer, the all-reduce) does not get faster")
        return line + "."
    if ratio < 1 - band and matmuls is not None and matmuls < 1 / BF16_WORTH_IT:
        return (f"bf16 trained at ×{ratio:#.2g} of fp32's speed: the lesson reversed, as the measurement above said it "
                f"would (bf16 matmuls ×{matmuls:#.2g} of fp32's here). Mixed precision pays only where the hardware "
                "multiplies the narrow format natively: a CPU with avx512_bf16 or AMX, a GPU's tensor cores.")
    if ratio < 1 - band:
        probe = f" although its matmuls measured ×{matmuls:#.2g} here" if matmuls else ""
        return (f"bf16 trained at ×{ratio:.2f} of fp32's speed{probe}: in this small model the matmuls are only part "
                "of the step, and autocast casts every weight to bf16 in each forward. A wider model (model.n_embd) "
                "gives the matmuls more of the step.")
    line = f"bf16 and fp32 trained equally fast within the step-to-step noise (×{ratio:.2f}, noise ±{band:.0%})"
    if matmuls and matmuls >= BF16_WORTH_IT:
        line += (f", although bf16's matmuls measured ×{matmuls:#.2g} here: in this small model the rest of the "
                 "step, which bf16 does not speed up, outweighs them")
    return line + "."


def comparison_verdict(results: dict[str, dict], plan: ComparisonPlan) -> str:
    """What the fp32-against-bf16 runs showed, in words rendered from their numbers: the speed (beside the noise
    and the probe: a result against the lesson is explained) and how far the loss curves drifted apart."""
    fp32, bf16 = results["fp32"], results["bf16"]
    ratio = bf16["summary"]["tokens_per_s"] / fp32["summary"]["tokens_per_s"]
    band = NOISE_SIGMAS * math.hypot(step_noise(fp32["tokens_per_s"]), step_noise(bf16["tokens_per_s"]))
    both = min(len(fp32["losses"]), len(bf16["losses"]))
    drift = max(abs(a - b) for a, b in zip(fp32["losses"][:both], bf16["losses"][:both]))
    loss = (f"Over the {both} steps both trained, the loss curves differ by at most {drift:.3f} nats/token "
            f"(bf16's rounding), on a loss that ends near {fp32['losses'][both - 1]:.2f}.")
    return wrap(_speed_line(ratio, band, plan) + "\n" + loss)


def comparison_figure(results: dict[str, dict]) -> Figure:
    """Left: the loss curves on top of each other. Right: throughput per precision."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax_loss, ax_tps = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    lengths = {len(r["steps"]) for r in results.values()}
    for mode, r in results.items():
        label = mode if len(lengths) == 1 else f"{mode} ({len(r['steps'])} steps)"
        ax_loss.plot(r["steps"], r["losses"], lw=1.8, color=COLORS.get(mode), label=label, alpha=0.85)
    floor = next((r["summary"].get("entropy_floor") for r in results.values() if r["summary"].get("entropy_floor")),
                 None)
    if floor:
        ax_loss.axhline(floor, ls="--", color="gray", label="entropy floor (exact)")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    label_axes(ax_loss, "Same seed, same data: the loss curves", "step", "train loss (nats/token)")
    rows = comparison_rows(results)
    bars = ax_tps.bar([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows],
                      color=[COLORS.get(r["mode"], "C4") for r in rows])
    for bar, r in zip(bars, rows):
        ax_tps.annotate(f"{r['tokens_per_s']:,.0f}\n×{r['speedup']:.2f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=11)
    ax_tps.margins(y=0.25)
    label_axes(ax_tps, "Throughput (steady state)", "precision", "tokens/s", legend=False)
    return fig


def formats_figure(rows: list[dict]) -> Figure:
    """Each format's range on a log₂ axis: subnormals (light), normal numbers (dark), eps written beside."""
    fig = Figure(figsize=(FIGURE_WIDTH, 3.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(reversed(rows)):
        lo, normal, hi = (math.log2(r[k]) for k in ("smallest_subnormal", "smallest_normal", "max"))
        ax.barh(i, normal - lo, left=lo, color="C0", alpha=0.3,
                label="subnormals (precision fades)" if i == 0 else None)
        ax.barh(i, hi - normal, left=normal, color="C0", label="normal numbers" if i == 0 else None)
        ax.text(hi + 3, i, f"eps = 2^{round(math.log2(r['eps']))}", va="center", fontsize=11)
    ax.set_yticks(range(len(rows)), [r["name"] for r in reversed(rows)], fontsize=12)
    ax.axvline(0, color="gray", lw=1)
    ax.set_xlim(right=max(math.log2(r["max"]) for r in rows) + 40)
    label_axes(ax, "Range of each format (log₂ of the magnitude)", "log₂ |x|", "", legend=True)
    return fig


def scaler_figure(trajectory: list[dict]) -> Figure:
    """The loss scale per step (log₂): it doubles after a run of clean steps and halves on each overflow;
    the overflowed steps (red) were skipped: the weights did not change."""
    fig = Figure(figsize=(FIGURE_WIDTH, 3.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    steps = [r["step"] for r in trajectory]
    ax.step(steps, [math.log2(r["scale_before"]) for r in trajectory], where="post", lw=2, label="loss scale used")
    bad = [r for r in trajectory if r["overflow"]]
    ax.scatter([r["step"] for r in bad], [math.log2(r["scale_before"]) for r in bad], s=120, color="#C44E52",
               zorder=3, label="overflow: step skipped, scale halved")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    label_axes(ax, "A GradScaler at work (real torch.amp.GradScaler, CPU)", "step", "log₂ loss scale")
    return fig
