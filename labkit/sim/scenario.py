"""The source text's 128-GPU scenario, run through the step model: every number here is *modelled*, none measured.

The source text tells of a 128-GPU cluster where communication is over a third of the step and scaling efficiency
is near 58%; mixed precision and gradient compression cut communication by 42% and efficiency reaches 83%. This
module asks the step model (:func:`labkit.sim.step.step_time`) what it predicts for that story, and where it holds.

**Scaling efficiency** (weak scaling): per-GPU throughput (model FLOP/s per GPU — at a fixed per-GPU batch, tokens/s
per GPU) of the job on ``GPUS`` GPUs ÷ the same on one node, same per-GPU layout, precision and network.

The set-up, all settings: pure data parallelism (ZeRO-0, gradients all-reduced once per step, overlapped with the
last micro-batch's backward) of GPT-2 small's shape on the catalog's ``dgx-a100-ethernet`` (DGX A100 nodes on
100 Gb/s Ethernet), 16 nodes = 128 GPUs. The baseline trains in fp32 (torch's default: TF32 off for matmuls, so the
catalog's fp32 peak); :func:`find_baseline` picks the per-GPU micro-batch whose modelled efficiency is nearest the
source's, among those with the exposed share above :data:`SCALING_COLLAPSES` that fit in memory.

* **mixed precision** = ``precision="bf16"``: gradients cross the wire in 2 bytes instead of 4, and the compute runs
  at the catalog's bf16 peak (16× the A100's fp32) — so the *share* of communication can rise while its time falls.
* **gradient compression** = the DP wire bytes divided by :data:`COMPRESSION_RATIO` (a setting:
  ``Layout.grad_compression``; latency unchanged).
* **the source's 42% cut** = the DP wire bytes × (1 − 0.42), the same way: a 42% cut of the bandwidth term.
"""
from __future__ import annotations

import dataclasses

from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS
from labkit.sim.cluster import Cluster, cluster
from labkit.sim.step import Layout, ModelShape, step_time

LABEL = "modelled (labkit.sim's step model), not measured"
GPUS = 128
CLUSTER = "dgx-a100-ethernet"
SHAPE = ModelShape(hidden=768, layers=12, heads=12, seq=1024, vocab=50257)  # GPT-2 small's shape
SOURCE = {"efficiency_before": 0.58, "cut": 0.42, "efficiency_after": 0.83}  # the source text's claims
COMPRESSION_RATIO = 16.0  # a setting: wire bytes ÷ 16 on top of mixed precision's halving
NEAR = 0.05  # "near 58%": within 5 points
BANDWIDTH_SCALES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0, 16.0)  # × the catalog's inter-node bandwidth
LATENCY_SCALES = (1.0, 10.0)  # × its latency


def network(base: Cluster, bandwidth: float = 1.0, latency: float = 1.0) -> Cluster:
    """``base`` with its inter-node link's bandwidth and latency scaled (NVLink inside a node unchanged)."""
    inter = dataclasses.replace(base.inter, bandwidth=base.inter.bandwidth * bandwidth,
                                latency=base.inter.latency * latency)
    return dataclasses.replace(base, name=f"{base.name} (inter ×{bandwidth:g} bw, ×{latency:g} latency)", inter=inter)


def point(shape: ModelShape, layout: Layout, base: Cluster, gpus: int, precision: str, compression: float = 1.0):
    """The step breakdown of ``layout`` data-parallel over ``gpus`` GPUs, its DP bytes ÷ ``compression``."""
    lay = dataclasses.replace(layout, dp=gpus // (layout.tp * layout.pp), grad_compression=compression)
    return step_time(shape, lay, base.with_gpus(gpus), precision)


def efficiency(shape: ModelShape, layout: Layout, base: Cluster, precision: str = "fp32", gpus: int = GPUS,
               compression: float = 1.0) -> dict:
    """Scaling efficiency at ``gpus`` (over one node) and the exposed communication share there, as data."""
    big = point(shape, layout, base, gpus, precision, compression)
    node = point(shape, layout, base, base.gpus_per_node, precision, compression)
    per_gpu = lambda s: s.model_flops / s.total / s.gpus  # noqa: E731
    return {"gpus": gpus, "precision": precision, "micro_batch": layout.micro_batch,
            "micro_batches": layout.micro_batches, "efficiency": per_gpu(big) / per_gpu(node),
            "exposed_share": big.dp_comm_exposed / big.total, "dp_comm_s": big.dp_comm_hidden + big.dp_comm_exposed,
            "step_s": big.total, "fits": big.fits, "label": LABEL}


def find_baseline(base: Cluster = None, shape: ModelShape = SHAPE, precision: str = "fp32",
                  target: float = SOURCE["efficiency_before"], micro_batches: int = 1) -> dict:
    """The per-GPU micro-batch (1–64) whose modelled efficiency is nearest ``target``, with the exposed share
    above SCALING_COLLAPSES and the memory fitting; None if none qualifies."""
    base = base or cluster(CLUSTER)
    found = [efficiency(shape, Layout(micro_batch=b, micro_batches=micro_batches), base, precision)
             for b in range(1, 65)]
    found = [r for r in found if r["exposed_share"] > SCALING_COLLAPSES and r["fits"]]
    return min(found, key=lambda r: abs(r["efficiency"] - target), default=None)


def _story(base: Cluster, layout: Layout) -> dict:
    """Before, after mixed precision, after it and compression, and after the source's cut, for one network."""
    before = efficiency(SHAPE, layout, base, "fp32")
    mixed = efficiency(SHAPE, layout, base, "bf16")
    both = efficiency(SHAPE, layout, base, "bf16", compression=COMPRESSION_RATIO)
    cut = efficiency(SHAPE, layout, base, "fp32", compression=1 / (1 - SOURCE["cut"]))
    needed = cut_needed(base, layout)
    for r in (mixed, both, cut) + ((needed,) if needed else ()):
        r["comm_cut"] = 1 - r["dp_comm_s"] / before["dp_comm_s"]
    return {"before": before, "mixed_precision": mixed, "mixed_precision_and_compression": both,
            "source_cut": cut, "source_cut_reaches": cut["efficiency"] >= SOURCE["efficiency_after"],
            "cut_needed": needed,
            "story_holds": (before["exposed_share"] > SCALING_COLLAPSES
                            and abs(before["efficiency"] - SOURCE["efficiency_before"]) <= NEAR
                            and cut["efficiency"] >= SOURCE["efficiency_after"])}


def cut_needed(base: Cluster, layout: Layout, target: float = SOURCE["efficiency_after"]) -> dict | None:
    """The smallest cut of the fp32 baseline's DP bytes that brings efficiency to ``target`` (bisection on the
    compression ratio, to 0.1% of the bytes); None if even a 1000× cut does not."""
    low, high = 1.0, 1000.0
    if efficiency(SHAPE, layout, base, "fp32", compression=high)["efficiency"] < target:
        return None
    while 1 / low - 1 / high > 1e-3:
        mid = (low + high) / 2
        low, high = (mid, high) if efficiency(SHAPE, layout, base, "fp32", compression=mid)["efficiency"] < target \
            else (low, mid)
    return {**efficiency(SHAPE, layout, base, "fp32", compression=high), "bytes_cut": 1 - 1 / high}


def network_sweep(layout: Layout, bandwidths=BANDWIDTH_SCALES, latencies=LATENCY_SCALES) -> list[dict]:
    """The same workload on networks with the inter-node bandwidth and latency scaled: one row per network."""
    rows = []
    for lat in latencies:
        for bw in bandwidths:
            c = network(cluster(CLUSTER), bw, lat)
            rows.append({"bandwidth_scale": bw, "latency_scale": lat,
                         "inter_gb_s": c.inter.bandwidth / 1e9, "latency_us": c.inter.latency * 1e6,
                         **_story(c, layout), "label": LABEL})
    return rows


def scenario(bandwidths=BANDWIDTH_SCALES, latencies=LATENCY_SCALES) -> dict:
    """The whole scenario as data, every value labelled modelled."""
    base = find_baseline()
    layout = Layout(micro_batch=base["micro_batch"])
    # the same tokens per GPU in four micro-batches (gradient accumulation): less backward to hide under
    accumulated = Layout(micro_batch=max(1, base["micro_batch"] // 4), micro_batches=4)
    return {"label": LABEL, "cluster": CLUSTER, "gpus": GPUS, "shape": SHAPE, "compression_ratio": COMPRESSION_RATIO,
            "source": SOURCE, "lines": {"holds": SCALING_HOLDS, "collapses": SCALING_COLLAPSES},
            "layout": layout, **_story(cluster(CLUSTER), layout),
            "accumulated": _story(cluster(CLUSTER), accumulated),
            "network_sweep": network_sweep(layout, bandwidths, latencies)}


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def format_scenario(result: dict) -> str:
    """The scenario as plain text, each block saying it is modelled."""
    lay = result["layout"]
    lines = [f"The 128-GPU scenario — {result['label']}",
             f"{result['cluster']}, {result['gpus']} GPUs, pure DP, micro-batch {lay.micro_batch} × 1 per GPU",
             "efficiency = per-GPU throughput at 128 GPUs ÷ at one node", "",
             f"  {'':34s} {'exposed comm':>12s} {'efficiency':>10s} {'comm cut':>9s}"]
    names = [("before (fp32)", "before"), ("mixed precision (bf16)", "mixed_precision"),
             (f"bf16 + compression ÷{result['compression_ratio']:g}", "mixed_precision_and_compression"),
             ("the source's cut, applied to fp32", "source_cut"),
             (f"the cut that reaches {_pct(SOURCE['efficiency_after']).strip()}", "cut_needed")]
    for name, key in names:
        r = result[key]
        if r is None:
            lines.append(f"  {name:34s} none: not even a 1000× cut of the bytes")
            continue
        cut = _pct(r["comm_cut"]) if "comm_cut" in r else ""
        lines.append(f"  {name:34s} {_pct(r['exposed_share']):>12s} {_pct(r['efficiency']):>10s} {cut:>9s}")
    acc = result["accumulated"]
    lines += ["", f"  the source's cut reaches its efficiency (modelled): "
              f"{'yes' if result['source_cut_reaches'] else 'no'}",
              f"  with 4 micro-batches of gradient accumulation instead (modelled): "
              f"before {_pct(acc['before']['efficiency']).strip()},",
              f"  after the cut {_pct(acc['source_cut']['efficiency']).strip()}", "",
              "network sweep (inter-node link; modelled):",
              f"  {'GB/s per GPU':>12s} {'latency µs':>10s} {'exposed':>8s} {'eff':>7s} {'eff cut':>8s} "
              f"{'eff bf16+c':>10s} {'cut needed':>10s}  story holds"]
    for r in result["network_sweep"]:
        lines.append(f"  {r['inter_gb_s']:12.2f} {r['latency_us']:10.0f} {_pct(r['before']['exposed_share']):>8s} "
                     f"{_pct(r['before']['efficiency']):>7s} {_pct(r['source_cut']['efficiency']):>8s} "
                     f"{_pct(r['mixed_precision_and_compression']['efficiency']):>10s} "
                     f"{_pct(r['cut_needed']['comm_cut']) if r['cut_needed'] else 'none':>10s}  "
                     f"{'yes' if r['story_holds'] else 'no'}")
    return "\n".join(lines)
