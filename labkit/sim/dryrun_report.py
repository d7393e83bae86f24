"""A dry run as plain text: the step's collectives, the rank's memory beside its predictions, and the
recorded-vs-analytic rows of :func:`labkit.sim.dryrun_counts.compare` (what ``labkit sim dryrun`` prints)."""
from __future__ import annotations

from fractions import Fraction

from labkit.sim.dryrun_counts import compare, implementation_memory, model_rows
from labkit.text import PRINT_WIDTH, wrap  # noqa: F401 (no line of the report is longer)


def collective_table(result: dict) -> list[dict]:
    """The step's collectives grouped by (axis, kind, group size, source): count, bytes, wire bytes."""
    rows: dict = {}
    for c in result["calls"]:
        key = (c.axis, c.kind, c.group_size, c.source)
        row = rows.setdefault(key, {"axis": c.axis, "kind": c.kind, "group": c.group_size, "source": c.source,
                                    "count": 0, "bytes": 0, "wire_bytes": 0})
        row["count"] += 1
        row["bytes"] += c.nbytes
        row["wire_bytes"] += c.wire
    return sorted(rows.values(), key=lambda r: (r["axis"], r["kind"], r["source"]))


def _num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, Fraction):
        return f"{x.numerator:,}" if x.denominator == 1 else f"{float(x):,.3f}"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3f}"


def _heading(result: dict) -> list[str]:
    mesh, cp = result["mesh"], result["cfg"].parallel.cp
    axes = " × ".join(f"{axis} {size}" for axis, size in mesh.items()  # the mesh's order; ep is part of dp
                      if axis not in ("cp", "ep") or size > 1 and axis != "ep")
    lines = ["labkit sim dryrun", f"  {result['label']}",
             f"world {result['world']} = {axes}; rank {result['rank']} at {result['coordinate']}",
             f"strategy {result['strategy']}; {result['micro_batches']} micro-batch(es); "
             f"{result['params']:,} parameters on this rank"]
    if mesh["cp"] > 1:
        lines.append(f"context parallel: {cp.impl}, {cp.layout} chunks; gradients averaged over dp × cp = "
                     f"{mesh['dp'] * mesh['cp']} ranks")
    if mesh.get("ep", 1) > 1:
        lines.append(f"expert parallel: ep {mesh['ep']} of the dp ranks each hold 1/{mesh['ep']} of the experts;")
        lines.append(f"  their gradients summed over the {result['expert_replicas']} ranks holding the same")
    if result["step_skipped"]:
        lines.append("the step dropped its update (non-finite gradient norm): no optimizer state")
    return lines


def _collective_lines(result: dict) -> list[str]:
    lines = ["collectives of one training step (this rank):",
             f"  {'axis':12s} {'kind':14s} {'group':>6s} {'via':7s} {'count':>6s} {'bytes':>14s} {'wire bytes':>14s}"]
    for r in collective_table(result):
        lines.append(f"  {r['axis']:12s} {r['kind']:14s} {r['group']:6d} {r['source']:7s} {r['count']:6d} "
                     f"{r['bytes']:14,d} {r['wire_bytes']:14,d}")
    return lines


def _memory_lines(result: dict) -> list[str]:
    exact = implementation_memory(result)
    lines = ["model-state memory of this rank (bytes): measured; predicted, the ZeRO paper's Ψ/p",
             "(p: the dp × cp ranks); exact, labkit's own with padding and ZeRO's slice copy",
             f"  {'':10s} {'measured':>14s} {'predicted':>14s} {'exact':>14s}"]
    for key in ("param", "grad", "optimizer"):
        lines.append(f"  {key:10s} {_num(result['memory'][key]):>14s} {_num(result['predicted_memory'][key]):>14s} "
                     f"{_num(exact[key]):>14s}")
    return lines


def _comparison_lines(result: dict) -> list[str]:
    rows = compare(result)
    width = max([len("what")] + [len(r["what"]) for r in rows])
    lines = ["recorded vs analytic:", f"  {'what':{width}s} {'recorded':>14s} {'analytic':>14s}  equal"]
    for r in rows:
        lines.append(f"  {r['what']:{width}s} {_num(r['recorded']):>14s} {_num(r['analytic']):>14s}  "
                     f"{'yes' if r['equal'] else 'NO'}")
    return lines


def _model_lines(result: dict) -> list[str]:
    rows = model_rows(result)
    if not rows:
        return ["recorded vs labkit.sim.step's own terms: no axis with more than one rank"]
    lines = ["recorded vs labkit.sim.step's own terms (the model's bytes: tp_messages, pp_messages, dp_messages,",
             "cp_messages):",
             f"  {'axis':4s} {'recorded':>14s} {'model':>14s} {'recorded/model':>14s}"]
    for r in rows:
        ratio = f"{float(r['recorded'] / r['model']):.4f}" if r["model"] else "—"
        lines.append(f"  {r['axis']:4s} {_num(r['recorded']):>14s} {_num(r['model']):>14s} {ratio:>14s}")
    return lines + [wrap(f"  {r['axis']}, not in the model: {r['leaves_out']}", indent="    ") for r in rows]


def format_result(result: dict) -> str:
    """The collective table, memory beside the prediction, the analytic comparison and the step model's own terms,
    as plain text."""
    parts = (_heading, _collective_lines, _memory_lines, _comparison_lines, _model_lines)
    return "\n\n".join("\n".join(part(result)) for part in parts)
