"""How far the step model is from real runs: published Megatron-LM and ZeRO-3 measurements, point by point.

The facts are transcribed into ``labkit/sim/reference/*.csv``, each with its paper in a header comment:

* ``megatron_2019_weak_scaling.csv`` — Shoeybi et al. 2019 (arXiv:1909.08053), Table 1 / Fig. 5:
  weak-scaling efficiency of 1.2B–8.3B GPTs on DGX-2H V100s, model parallel (1–8 GPUs) and model +
  64-way data parallel (64–512 GPUs). Bar: within 8 percentage points.
* ``megatron_ptdp_2021_table2_vs_zero3.csv`` — Narayanan et al. 2021 (arXiv:2104.04473), Table 2:
  TFLOP/s per A100 of ZeRO-3 (no model parallelism) and PTD-P at a fixed global batch as the GPUs
  double. Bar: within 20 % per point, and the same shape (ZeRO-3 collapses, PTD-P barely falls).
* ``megatron_korthikanti_2022_mfu_hfu.csv`` with ``korthikanti_2022_table3_layouts.csv`` — Korthikanti
  et al. 2022 (arXiv:2205.05198): MFU and HFU with selective recompute and sequence parallelism.
  Bar: within 10 % (relative).

The model has four constants (:data:`labkit.sim.step.PARAMETERS`). Two efficiencies (matmul, network) are fitted
once to *all* points together (:func:`fit_constants`: the pair on a 0.01 grid that minimises the worst error
measured in units of its table's bar, the shape rows included); the V100's matmul rate is derived from Shoeybi et
al.'s measured 1-GPU baseline (:func:`v100_2019_efficiency`); the compute slowdown beside a hidden collective is a
published measurement (Lee et al. 2025, arXiv:2507.03114), not fitted. Nothing is tuned per point; a missed bar
stays in the table as ``held=False``. Every row says what it is to the fit (``role``: fitted on, derived, held
out); :mod:`labkit.sim.validate_holdout` fits on two papers and predicts the third, out of sample.

Each paper's own FLOP count is used for its own metric: Narayanan et al. count 96·B·s·l·h²·(1 + s/6h
+ V/16lh) per step (full recompute included), Korthikanti et al. 72·B·s·l·h²·(1 + s/6h + V/12lh) for
MFU and 72·B·s·l·h²·(1 + s/3h + V/12lh) for HFU; the 2019 weak scaling is throughput per GPU relative to
the model's own 1-GPU baseline.
"""
from __future__ import annotations

import csv
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from labkit.sim import step
from labkit.sim.cluster import cluster
from labkit.sim.step import Layout, ModelShape, step_time

REFERENCE = Path(__file__).parent / "reference"
A100_PEAK = 312e12  # the papers' own peak (bf16/fp16 dense)
# Shoeybi et al. 2019 measured their 1-GPU rate: 39 TFLOP/s = 30% of the V100's 125 (Table 1 / §5), counting
# every FLOP the GPU ran (recomputation included). That measurement, not a fit, sets the V100's matmul rate
# (v100_2019_efficiency, written as step.V100_MATMUL_EFFICIENCY: a derived parameter); the weak-scaling points then
# test the communication. (MATMUL_EFFICIENCY is fitted on the A100 runs: 2019 V100 kernels were not as efficient.)
V100_2019_TFLOPS = 39.0


# What a point is to the fit. FITTED: an independent published point the efficiencies were fitted on. DERIVED: a
# point that follows from others, no independent test (the weak-scaling baseline, 100% by construction and the point
# the V100 rate is derived from; the shape rows, ratios of a series' points; HFU, MFU times a fixed FLOP ratio).
# HELD_OUT: an independent point the constants were not fitted on (labkit.sim.validate_holdout).
FITTED, DERIVED, HELD_OUT = "fitted on", "derived", "held out"


@dataclass(frozen=True)
class Row:
    """One compared point: ``error`` is predicted − published (points for %, else relative); ``role`` what it is to
    the fit (:data:`FITTED`, :data:`DERIVED` or :data:`HELD_OUT`)."""
    paper: str
    point: str
    published: Union[float, str]
    predicted: Union[float, str]
    error: Union[float, str]
    target: str
    held: bool
    bar_units: float = 0.0  # |error| / bar (the fit's objective)
    role: str = FITTED


def read_reference(name: str) -> list[dict]:
    """Rows of a reference CSV, its ``#`` comment lines skipped."""
    lines = [line for line in (REFERENCE / name).read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


# ------------------------------------------------------------------ Shoeybi et al. 2019 (V100)

def shape_2019(r: dict) -> ModelShape:
    return ModelShape(int(r["hidden"]), int(r["layers"]), int(r["heads"]), 1024, 51200)


def v100_2019_efficiency(r: dict) -> float:
    """The matmul efficiency at which the model's 1-GPU step of ``r`` runs at the measured 39 TFLOP/s: the
    step's FLOPs (recompute included) over 39 TFLOP/s is matmul time plus the memory-bound kernels."""
    lay, c = Layout(micro_batch=8, recompute="full"), cluster("dgx2h-v100", 1)
    s = step_time(shape_2019(r), lay, c, "fp16", 1.0, 1.0)  # at efficiency 1: the pure-matmul seconds
    matmul = s.compute + s.recompute
    memory_bound = s.attention_memory + s.elementwise_memory
    return matmul / (matmul * c.gpu.peak_flops("fp16") / (V100_2019_TFLOPS * 1e12) - memory_bound)


def megatron_2019(eff=None, net=None, slow=None, v100=None) -> list[Row]:
    """Weak scaling: per-GPU throughput of each run over the 1.2B model's on one GPU.

    The V100 runs at ``v100`` (default :data:`labkit.sim.step.V100_MATMUL_EFFICIENCY`, derived from the paper's
    measured 39 TFLOP/s); ``eff``, the A100 runs' matmul efficiency, does not apply here, only ``net``."""
    rows, refs = [], read_reference("megatron_2019_weak_scaling.csv")
    eff = step.V100_MATMUL_EFFICIENCY if v100 is None else v100

    def per_gpu(r, tp, dp):
        lay = Layout(dp=dp, tp=tp, micro_batch=8, recompute="full")
        s = step_time(shape_2019(r), lay, cluster("dgx2h-v100", lay.gpus), "fp16", eff, net, slow)
        return s.model_flops / s.total / s.gpus

    base = per_gpu(refs[0], 1, 1)
    for r in refs:
        tp = int(r["mp_gpus"])
        for kind, dp, col in (("model parallel", 1, "mp_weak_scaling_pct"),
                              ("model+data parallel", 64, "mpdp_weak_scaling_pct")):
            published, predicted = float(r[col]), 100 * per_gpu(r, tp, dp) / base
            err = predicted - published
            baseline = tp * dp == 1
            rows.append(Row("Shoeybi 2019", f"{r['params_B']}B {kind}, {tp * dp} GPUs{' (baseline)' * baseline}",
                            published, round(predicted, 1), round(err, 1), "within 8 points", abs(err) <= 8,
                            abs(err) / 8, DERIVED if baseline else FITTED))
    return rows


# ------------------------------------------------------------------ Narayanan et al. 2021 Table 2 (A100)

SHAPES_2021 = {"174.6": ModelShape(12288, 96, 96, 2048, 51200), "529.6": ModelShape(20480, 105, 128, 2048, 51200)}


def ptdp_flops(shape: ModelShape, batch: int) -> float:
    """Narayanan et al.'s FLOPs per step (eq. 3, full recompute): 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    s, h, L, V = shape.seq, shape.hidden, shape.layers, shape.vocab
    return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def ptdp_2021_layout(r: dict) -> tuple[ModelShape, Layout, int]:
    gpus, batch, mb = int(r["gpus"]), int(r["global_batch"].rstrip("*")), int(r["microbatch"])
    mp = int(r["model_parallel_size"])
    if r["scheme"] == "ZeRO-3":
        lay = Layout(dp=gpus, micro_batch=mb, micro_batches=batch // (gpus * mb), zero=3, recompute="full")
    else:
        dp = gpus // mp
        lay = Layout(dp=dp, tp=8, pp=mp // 8, micro_batch=mb, micro_batches=batch // (dp * mb), recompute="full")
    return SHAPES_2021[r["params_B"]], lay, batch


def ptdp_2021(eff=None, net=None, slow=None) -> list[Row]:
    """TFLOP/s per GPU of ZeRO-3 and PTD-P, each point, then the shape of each series."""
    rows, series = [], {}
    for r in read_reference("megatron_ptdp_2021_table2_vs_zero3.csv"):
        shape, lay, batch = ptdp_2021_layout(r)
        s = step_time(shape, lay, cluster("dgx-a100", lay.gpus), "bf16", eff, net, slow)
        predicted, published = ptdp_flops(shape, batch) / s.total / lay.gpus / 1e12, float(r["tflops_per_gpu"])
        err = predicted / published - 1
        rows.append(Row("Narayanan 2021", f"{r['scheme']} {r['params_B']}B, {lay.gpus} GPUs", published,
                        round(predicted, 1), round(err, 3), "within 20%", abs(err) <= 0.20, abs(err) / 0.20))
        series.setdefault((r["scheme"], r["params_B"]), []).append((lay.gpus, published, predicted))
    for (scheme, params), pts in series.items():
        pts.sort()
        pub, pred = [p[1] for p in pts], [p[2] for p in pts]
        falls = all(a > b for a, b in zip(pred, pred[1:]))
        # the shape: the same falls, and ZeRO-3's fall (last/first) within 20% of the published one
        ratio_pub, ratio_pred = pub[-1] / pub[0], pred[-1] / pred[0]
        ok = falls and abs(ratio_pred / ratio_pub - 1) <= 0.20
        rows.append(Row("Narayanan 2021", f"shape: {scheme} {params}B, last/first", round(ratio_pub, 3),
                        round(ratio_pred, 3), round(ratio_pred / ratio_pub - 1, 3),
                        "falls with GPUs; ratio within 20%", ok, abs(ratio_pred / ratio_pub - 1) / 0.20, DERIVED))
    return rows


# ------------------------------------------------------------------ Korthikanti et al. 2022 (A100)

def korthikanti_2022(eff=None, net=None, slow=None) -> list[Row]:
    """MFU and HFU with selective recompute and sequence parallelism, DP size 1."""
    rows = []
    layouts = {r["model"]: r for r in read_reference("korthikanti_2022_table3_layouts.csv")}
    for r in read_reference("megatron_korthikanti_2022_mfu_hfu.csv"):
        k = layouts[r["model"]]
        shape = ModelShape(int(k["hidden"]), int(k["layers"]), int(k["heads"]), 2048, 51200)
        tp, pp, mb, batch = int(k["tp"]), int(k["pp"]), int(k["micro_batch"]), int(k["global_batch"])
        lay = Layout(tp=tp, pp=pp, micro_batch=mb, micro_batches=batch // mb, recompute="selective",
                     sequence_parallel=True)
        s = step_time(shape, lay, cluster("dgx-a100", lay.gpus), "bf16", eff, net, slow)
        sh, h, L, V = 2048, shape.hidden, shape.layers, shape.vocab
        base = 72 * batch * sh * L * h * h / (s.total * lay.gpus * A100_PEAK)
        for what, extra in (("MFU", sh / (6 * h)), ("HFU", sh / (3 * h))):
            predicted, published = 100 * base * (1 + extra + V / (12 * h * L)), float(r[f"{what.lower()}_pct"])
            err = predicted / published - 1
            rows.append(Row("Korthikanti 2022", f"{r['model']} {what} (TP{tp} PP{pp}, {lay.gpus} GPUs)", published,
                            round(predicted, 1), round(err, 3), "within 10%", abs(err) <= 0.10, abs(err) / 0.10,
                            FITTED if what == "MFU" else DERIVED))
    return rows


TABLES = {"Shoeybi 2019": megatron_2019, "Narayanan 2021": ptdp_2021, "Korthikanti 2022": korthikanti_2022}
PAPERS = tuple(TABLES)
V100_PAPER = "Shoeybi 2019"  # the paper whose table runs on V100s (its baseline sets step.V100_MATMUL_EFFICIENCY)


def validation_table(eff=None, net=None, slow=None, papers=PAPERS, v100=None) -> list[Row]:
    """Every published point of ``papers`` against the model (the model's constants unless ``eff``/``net``/``slow``
    /``v100`` are given; ``v100`` reaches only the V100 paper, ``eff`` the others)."""
    return [row for paper in papers for row in (megatron_2019(eff, net, slow, v100) if paper == V100_PAPER
                                                 else TABLES[paper](eff, net, slow))]


@functools.lru_cache(maxsize=None)
def fit_constants(slow: float | None = None, papers: tuple = PAPERS, v100: float | None = None) -> tuple[float, float]:
    """The (matmul, network) efficiencies minimising the worst error in bar units over the points of ``papers`` (all
    three unless told; ties: the smaller sum of squares), the overlap cost held at ``slow`` (default: the measured
    :data:`labkit.sim.step.OVERLAP_COST`), the V100 at ``v100`` (default: its derived rate): a 0.05 grid, then a
    0.01 grid around its best."""
    slow = step.OVERLAP_COST if slow is None else slow

    def score(pair):
        units = [r.bar_units for r in validation_table(*pair, slow, papers, v100)]
        return (round(max(units), 6), round(sum(u * u for u in units), 6))

    def grid(low: float, high: float, step: float) -> list[float]:
        return [round(low + i * step, 2) for i in range(int(round((high - low) / step)) + 1)]

    def best(*axes):
        return min(itertools.product(*axes), key=score)

    coarse = best(grid(0.40, 0.90, 0.05), grid(0.20, 1.00, 0.05))
    near = [[x for x in grid(c - 0.04, c + 0.04, 0.01) if 0 <= x <= 1] for c in coarse]
    return best(*near)


def constants(eff=None, net=None, slow=None) -> tuple[float, float, float]:
    """The (matmul, network, overlap) constants a table uses: the given ones, else the fitted ones."""
    return (step.MATMUL_EFFICIENCY if eff is None else eff, step.NETWORK_EFFICIENCY if net is None else net,
            step.OVERLAP_COST if slow is None else slow)


def format_table(rows: list[Row] = None, eff=None, net=None, slow=None) -> str:
    """The in-sample table as text: :func:`labkit.sim.validate_report.format_table` (the text lives there)."""
    from labkit.sim import validate_report  # it imports this module

    return validate_report.format_table(rows, eff, net, slow)
