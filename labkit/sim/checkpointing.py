"""How often to checkpoint a large job: Young's interval at 64 to 16,384 GPUs, every number *modelled*.

A job of N GPUs stops whenever any of them (or its host, or its network) fails. If each GPU fails on its own,
at a constant rate, the job's mean time between failures is the per-GPU one divided by N:

    M = M_gpu / N

— so a failure that one GPU sees every few years, a 16,384-GPU job sees every few hours. Each checkpoint
blocks training for δ seconds; each failure loses, on average, half an interval of work. Young's interval
τ* = √(2δM) balances the two (:func:`labkit.fault.recovery.young_daly_interval`), and the fraction of the
wall clock lost is δ/τ + τ/2M (:func:`labkit.fault.recovery.expected_overhead`); at τ* it is √(2δ/M). The
goodput here is 1 − that: restart time (detect, reschedule, reload) is *not* counted, and it grows with N too.
Young's formula assumes δ ≪ M; Daly 2006 refines it when that fails (the table shows δ/M).

**What a checkpoint holds.** The model states needed to continue: the parameters and the optimizer state
(under mixed precision, the fp32 master weights and Adam's two moments), as the step model says each GPU
holds them (``memory_parameters + memory_optimizer`` of :func:`labkit.sim.step.step_time`). Not the gradients
(the next step rebuilds them) nor the activations. With ZeRO-1 each GPU owns 1/dp of the optimizer state and
writes it; the first data-parallel rank of each model-parallel group also writes the parameters — it is the
slowest writer, and it sets δ = its bytes / its write bandwidth (all GPUs write at once).

**The settings**, each a number someone chose (change them in the calls):

* the failure rate: :data:`LLAMA3_SNAPSHOT` — Dubey et al. 2024, *The Llama 3 Herd of Models*
  (arXiv:2407.21783) §3.3.4: 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384
  H100 GPUs. Charging every interruption to a GPU gives :data:`PER_GPU_MTBF_S` ≈ 5.8 years per GPU.
* the write bandwidth: :data:`WRITE_BYTES_PER_S` = 1 GB/s per GPU — *illustrative*, not a measurement (a node
  of 8 GPUs writing 8 GB/s to shared storage).
* the job: GPT-3 175B's shape (Narayanan et al. 2021) laid out as Korthikanti et al. 2022 ran it (tp 8 × pp 8,
  selective recompute, sequence parallelism), with ZeRO-1, global batch 1,536 (Narayanan et al. 2021, Table 2),
  bf16, on the catalog's DGX A100 cluster; the GPUs grow by data parallelism.
"""
from __future__ import annotations

import dataclasses

from labkit.fault.recovery import expected_overhead, young_daly_interval
from labkit.sim.cluster import cluster
from labkit.sim.scenario import LABEL
from labkit.sim.step import Layout, ModelShape, StepBreakdown, step_time
from labkit.sim.validate import SHAPES_2021

LLAMA3_SNAPSHOT = {"days": 54, "gpus": 16_384, "unexpected_interruptions": 419}  # Dubey et al. 2024, §3.3.4
PER_GPU_MTBF_S = (LLAMA3_SNAPSHOT["days"] * 86_400 * LLAMA3_SNAPSHOT["gpus"]
                  / LLAMA3_SNAPSHOT["unexpected_interruptions"])
WRITE_BYTES_PER_S = 1e9  # per GPU: an illustrative setting
FIXED_INTERVAL_S = 3600.0  # a hand-set "once an hour", for comparison: an illustrative setting
SHAPE: ModelShape = SHAPES_2021["174.6"]  # GPT-3 175B
MODEL_PARALLEL = Layout(tp=8, pp=8, zero=1, recompute="selective", sequence_parallel=True)
GLOBAL_BATCH = 1536  # sequences per step
CLUSTER = "dgx-a100"
PRECISION = "bf16"
GPU_COUNTS = tuple(2 ** k for k in range(6, 15))  # 64 … 16,384
HEADLINE_GPUS = 1024
HOUR, YEAR = 3600.0, 365.25 * 86_400


def checkpoint_bytes(s: StepBreakdown) -> float:
    """Bytes the slowest GPU writes per checkpoint: its parameters and optimizer state (see the docstring)."""
    return s.memory_parameters + s.memory_optimizer


def job_step(gpus: int, shape: ModelShape = SHAPE, model_parallel: Layout = MODEL_PARALLEL,
             global_batch: int = GLOBAL_BATCH, cluster_name: str = CLUSTER) -> StepBreakdown:
    """The modelled step of ``model_parallel`` grown by data parallelism to ``gpus`` GPUs."""
    dp = gpus // (model_parallel.tp * model_parallel.pp)
    if dp < 1 or dp * model_parallel.tp * model_parallel.pp != gpus:
        split = model_parallel.tp * model_parallel.pp
        raise ValueError(f"{gpus} GPUs is not a whole number of tp·pp = {split} groups")
    layout = dataclasses.replace(model_parallel, dp=dp,
                                 micro_batches=max(1, global_batch // (dp * model_parallel.micro_batch)))
    return step_time(shape, layout, cluster(cluster_name, gpus), PRECISION)


def young_daly(gpus: int, per_gpu_mtbf_s: float = PER_GPU_MTBF_S, write_bytes_per_s: float = WRITE_BYTES_PER_S,
               **job) -> dict:
    """Young's interval and the expected overhead for the job on ``gpus`` GPUs (``job``: :func:`job_step`'s)."""
    s = job_step(gpus, **job)
    delta, mtbf = checkpoint_bytes(s) / write_bytes_per_s, per_gpu_mtbf_s / gpus
    tau = young_daly_interval(delta, mtbf)
    best, hourly = expected_overhead(tau, delta, mtbf), expected_overhead(FIXED_INTERVAL_S, delta, mtbf)
    split = job.get("model_parallel", MODEL_PARALLEL)
    return {"gpus": gpus, "dp": gpus // (split.tp * split.pp),
            "checkpoint_bytes": checkpoint_bytes(s), "checkpoint_s": delta, "mtbf_s": mtbf, "interval_s": tau,
            "step_s": s.total, "interval_steps": tau / s.total, "saving": best["saving"],
            "lost_work": best["lost_work"], "overhead": best["total"], "goodput": 1 - best["total"],
            "fixed_interval_s": FIXED_INTERVAL_S, "fixed_overhead": hourly["total"], "delta_over_mtbf": delta / mtbf,
            "fits": s.fits, "label": LABEL}


def young_daly_sweep(gpu_counts=GPU_COUNTS, **settings) -> list[dict]:
    """:func:`young_daly` at each GPU count: one row each."""
    return [young_daly(g, **settings) for g in gpu_counts]


# ---------------------------------------------------------------- text and figure

def _duration(seconds: float) -> str:
    for unit, size in (("years", YEAR), ("h", HOUR), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def format_young_daly(row: dict, rows: list[dict] = ()) -> str:
    """The headline row in words, step by step, then the sweep as a table."""
    n = row["gpus"]
    lines = [f"Young's checkpoint interval at {n:,} GPUs — {row['label']}",
             f"job: GPT-3 175B's shape, tp {MODEL_PARALLEL.tp} × pp {MODEL_PARALLEL.pp} × dp "
             f"{n // (MODEL_PARALLEL.tp * MODEL_PARALLEL.pp)}, ZeRO-{MODEL_PARALLEL.zero}, {PRECISION}, on {CLUSTER}; "
             f"modelled step {row['step_s']:.2f} s",
             f"failure rate (setting): per-GPU MTBF {_duration(PER_GPU_MTBF_S)}, from Llama 3's "
             f"{LLAMA3_SNAPSHOT['unexpected_interruptions']} unexpected interruptions in {LLAMA3_SNAPSHOT['days']} "
             f"days on {LLAMA3_SNAPSHOT['gpus']:,} GPUs (Dubey et al. 2024, §3.3.4)",
             f"  job MTBF      M = per-GPU MTBF / {n:,} = {_duration(row['mtbf_s'])} (independent failures)",
             f"  checkpoint      parameters + optimizer state of the slowest writer: "
             f"{row['checkpoint_bytes'] / 1e9:.1f} GB per GPU (modelled)",
             f"  write time    δ = {row['checkpoint_bytes'] / 1e9:.1f} GB / {WRITE_BYTES_PER_S / 1e9:g} GB/s per GPU "
             f"(illustrative setting) = {row['checkpoint_s']:.1f} s",
             f"  interval     τ* = √(2δM) = {_duration(row['interval_s'])} ≈ every "
             f"{row['interval_steps']:,.0f} steps",
             f"  overhead        saving δ/τ {100 * row['saving']:.2f}% + lost work τ/2M "
             f"{100 * row['lost_work']:.2f}% "
             f"= {100 * row['overhead']:.2f}% → goodput {100 * row['goodput']:.2f}% (restarts not counted)",
             f"  once an hour instead: overhead {100 * row['fixed_overhead']:.2f}%"]
    if rows:
        lines += ["", f"{'GPUs':>7} {'job MTBF':>10} {'δ':>7} {'τ*':>9} {'steps':>7} {'overhead':>9} {'goodput':>8} "
                      f"{'hourly':>7} {'δ/M':>8}"]
        lines += [f"{r['gpus']:>7,} {_duration(r['mtbf_s']):>10} {r['checkpoint_s']:>6.1f}s "
                  f"{_duration(r['interval_s']):>9} {r['interval_steps']:>7,.0f} {100 * r['overhead']:>8.2f}% "
                  f"{100 * r['goodput']:>7.2f}% {100 * r['fixed_overhead']:>6.2f}% {r['delta_over_mtbf']:>8.1e}"
                  for r in rows]
        lines.append("(hourly: the overhead of checkpointing once an hour; δ/M ≪ 1 is Young's assumption)")
    return "\n".join(lines)


def checkpoint_text(gpus: int = HEADLINE_GPUS, quick: bool = False) -> str:
    """Young's interval at ``gpus`` GPUs in words, and the sweep 64 → 16,384 (``quick``: every other count)."""
    counts = GPU_COUNTS[::2] if quick else GPU_COUNTS
    return format_young_daly(young_daly(gpus), young_daly_sweep(counts))


def checkpoint_figure(quick: bool = False, width: float | None = None):
    """Left: τ* and the job MTBF against GPUs. Right: the overhead at τ* (saving + lost work) and once an hour.
    A matplotlib Figure, text at 12 pt or more at ``width`` inches."""
    from matplotlib.figure import Figure

    from labkit.plots import FIGURE_WIDTH, label_axes

    rows = young_daly_sweep(GPU_COUNTS[::2] if quick else GPU_COUNTS)
    x = [r["gpus"] for r in rows]
    fig = Figure(figsize=(width or FIGURE_WIDTH, 4.6), dpi=100, layout="constrained")
    ax_t, ax_o = fig.subplots(1, 2)
    ax_t.plot(x, [r["interval_s"] / 60 for r in rows], "o-", color="#4C72B0", label="τ* = √(2δM)")
    ax_t.plot(x, [r["mtbf_s"] / 60 for r in rows], "s--", color="#C44E52", label="job MTBF M")
    ax_t.set_yscale("log")
    label_axes(ax_t, "interval and MTBF", "GPUs", "minutes", legend=False)
    for key, name, style in (("overhead", "total at τ*", "o-"), ("saving", "saving = lost work at τ*", "^:"),
                             ("fixed_overhead", "total, hourly", "s--")):
        ax_o.plot(x, [100 * r[key] for r in rows], style, label=name)
    label_axes(ax_o, "time lost", "GPUs", "% of wall clock", legend=False)
    for ax in (ax_t, ax_o):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{g:,}" if g < 1000 else f"{g // 1024}K" for g in x])
        ax.axvline(HEADLINE_GPUS, color="#888888", linewidth=1)
        ax.tick_params(labelsize=12)
        ax.legend(fontsize=12)
    fig.suptitle(f"Checkpointing GPT-3 175B ({LABEL})", fontsize=13)
    return fig
