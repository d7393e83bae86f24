"""The calibration's table: each live run measured beside its prediction, as data and as text.

:func:`error_rows` (the benchmark writes them to ``benchmarks/results/sim_calibration.jsonl``) and
:func:`calibration_text` (notebook 10 prints it) — every step time measured, every prediction modelled.
"""
from __future__ import annotations

import dataclasses
from textwrap import indent
from typing import Optional

from labkit.sim.calibrate import (BAR, GLOO_RUNS_AS, TARGET_HELD_OUT_SHARE, TARGET_MIN_HELD_OUT, Calibration,
                                  Measured, held_out_count, predict, target_met)
from labkit.sim.layout import Layout
from labkit.sim.step import collective_seconds

def describe_layout(layout: Layout) -> str:
    parts = [f"{axis}={getattr(layout, axis)}" for axis in ("dp", "tp", "pp", "cp") if getattr(layout, axis) > 1]
    parts += [f"ZeRO-{layout.zero}"] * bool(layout.zero)
    return " ".join(parts + [f"{layout.micro_batches}×{layout.micro_batch} seq"])


def error_rows(runs: list[Measured], cal: Calibration) -> list[dict]:
    """Per run: measured and predicted step time, the error (predicted/measured − 1), whether it is within
    :data:`BAR` (``held``), and the predicted terms."""
    rows = []
    for r in runs:
        pred = predict(r.shape, r.layout, cal, r.processes, r.calls)
        error = pred["total"] / r.step_s - 1
        rows.append({"run": r.name, "processes": r.processes, "layout": describe_layout(r.layout),
                     "shape": dataclasses.asdict(r.shape), "held_out": r.held_out, "fit_for": r.fit_for,
                     "measured_s": r.step_s,
                     "predicted_s": pred["total"], "error": error, "held": abs(error) <= BAR,
                     "terms_s": {k: v for k, v in pred.items() if k != "total"}})
    return rows


def collective_rows(collectives: list[dict], cal: Calibration) -> list[dict]:
    """Each timed collective beside the model's time for the op on the fitted link and for what gloo runs in
    its place (:data:`GLOO_RUNS_AS`): how well one α, β serve every op."""
    def seconds(op, row):
        return collective_seconds(op, row["bytes"], row["world"], cal.link(row["world"]), 1.0)
    return [{**row, "model_s": seconds(row["op"], row),
             "as_gloo_runs_it_s": seconds(GLOO_RUNS_AS.get(row["op"], row["op"]), row)} for row in collectives]


def constants_text(cal: Calibration) -> str:
    """The fitted constants, a line each."""
    links = [f"gloo (ring), {p} processes: α {a * 1e3:.2f} ms per round, β {b / 1e9:.2f} GB/s" for p, a, b in cal.links]
    return "\n".join([f"rate {cal.rate / 1e9:.1f} GFLOP/s per process with a core to itself",
                      f"per-block overhead {cal.layer_overhead_s * 1e3:.2f} ms per micro-batch",
                      f"optimizer {cal.optimizer_s_per_param * 1e9:.2f} ns per parameter",
                      f"FSDP2 {cal.fsdp_unit_overhead_s * 1e3:.2f} ms per unit and micro-batch",
                      *[f"MoE layer {cal.moe_layer_overhead_s * 1e3:.2f} ms per micro-batch beyond its FLOPs"]
                      * bool(cal.moe_layer_overhead_s),
                      *[f"ep all-to-all, {p} processes: {s * 1e3:.2f} ms per call beyond its α–β time"
                        for p, s in cal.all_to_all_calls], *links])


def calibration_text(record: Optional[dict] = None) -> str:
    """The calibration table as text, from a ``benchmarks/sim_calibration.py`` results record (by default the
    newest full run in the shipped ``benchmarks/results/sim_calibration.jsonl``): the median round's table
    (fitted and judged there), each run's best-round error beside it and the held-out count on each. An older
    record, from before the median round was judged, prints its one table as it was measured."""
    if record is None:
        from labkit.results import latest, load_results

        record = latest(load_results("sim_calibration"), "calibration", quick=False)
    settings, machine, rows = record["settings"], record["machine"], record["rows"]
    both = all("best_round" in row for row in rows)  # the median round judged, the best round beside it
    load = settings["load_average_1min"]
    rounds = f"{settings['rounds']} rounds" if "rounds" in settings else "the rounds"
    statistic = (f"median of {rounds}" if both else
                 f"{'best' if 'best round' in settings.get('step_statistic', 'best round') else 'median'} of {rounds}")
    lines = [f"labkit.sim calibrated on {settings['cpu_model_name']} ({machine['cores']} cores, "
             f"torch {machine['torch']}), {record.get('date', 'undated')};",
             f"1-min load average {load[0]:.2f} before, {load[-1]:.2f} after",
             f"fitted (on this machine{', median round' if both else ''}):",
             indent(constants_text(Calibration.from_dict(settings["constants"])), "  "), "",
             f"step times measured (live runs: median of steady steps, {statistic}); predictions modelled",
             "(model: layers × width; p: processes on the machine's cores"
             + (";\n best: the error with the constants fitted, and every run measured, on the best round instead)"
                if both else ")"),
             f"{'run':9s} {'model':>7s} {'p':>2s}  {'layout':19s} {'measured':>9s} {'predicted':>9s} {'error':>6s}"
             + (f" {'best':>6s}" if both else "") + "  role"]
    for row in rows:
        role = (f"held out: {'within' if row['held'] else 'OUTSIDE'} ±{BAR:.0%}" if row["held_out"]
                else f"fit: {row.get('fit_for') or 'compute'}")
        model = f"{row['shape']['layers']}×{row['shape']['hidden']}"
        best = f" {row['best_round']['error']:+6.1%}" if both else ""
        lines.append(f"{row['run']:9s} {model:>7s} {row['processes']:2d}  {row['layout']:19s} "
                     f"{row['measured_s'] * 1e3:6.1f} ms {row['predicted_s'] * 1e3:6.1f} ms {row['error']:+6.1%}{best}"
                     f"  {role}")
    within, held_out = held_out_count(rows)
    if not both:
        lines.append(f"{within} of {held_out} held-out runs within ±{BAR:.0%}")
        return "\n".join(lines)
    best_within, _ = held_out_count([{**row, "held": row["best_round"]["held"]} for row in rows])
    target = f"{TARGET_HELD_OUT_SHARE:.0%} of at least {TARGET_MIN_HELD_OUT}: {'met' if target_met(rows) else 'MISSED'}"
    lines += [f"{within} of {held_out} held-out runs within ±{BAR:.0%} on the median round (judged; target {target})",
              f"{best_within} of {held_out} held-out runs within ±{BAR:.0%} on the best round (beside it, not judged)"]
    return "\n".join(lines)
