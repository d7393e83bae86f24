"""The validation as plain text: what ``labkit sim validate`` prints.

Two tables. The **in-sample** one (:func:`format_table`): every published point against the model with the
constants fitted on all three papers at once, each point labelled by its role — *fitted on* (the fit saw it),
*derived* (it follows from other points: no independent test) — and the count of independent points and of the
model's fitted or derived parameters. The **out-of-sample** one (:func:`format_holdout`): each paper predicted by
the efficiencies fitted on the other two (:mod:`labkit.sim.validate_holdout`), its errors beside the in-sample ones.
"""
from __future__ import annotations

from labkit.sim import gemm, step
from labkit.sim.validate import DERIVED, FITTED, HELD_OUT, Row, constants, validation_table
from labkit.sim.validate_holdout import Fold, leave_one_paper_out
from labkit.text import wrap

METRICS = {"Shoeybi 2019": "weak-scaling efficiency, %", "Narayanan 2021": "TFLOP/s per GPU",
           "Korthikanti 2022": "% of the A100's peak"}


def error_text(r: Row) -> str:
    """A row's error as printed: points for the weak-scaling %, else a signed percentage."""
    if r.target.endswith("points"):
        return f"{r.error:+.1f} pt"
    return f"{100 * r.error:+.1f}%" if isinstance(r.error, float) else str(r.error)


def constants_source(eff: float, net: float, slow: float) -> str:
    """Where a table's constants come from: the fit and the measurement, or a what-if."""
    fitted = (eff, net) == (step.MATMUL_EFFICIENCY, step.NETWORK_EFFICIENCY)
    measured = slow == step.OVERLAP_COST
    return ("the two efficiencies fitted" if fitted else "the efficiencies given") + "; " + (
        "the overlap cost measured by Lee et al. 2025, arXiv:2507.03114" if measured else "the overlap cost given")


def parameter_count() -> int:
    """The model's fitted or derived parameters (:data:`labkit.sim.step.PARAMETERS`; measured ones not counted)."""
    return sum(not what.startswith("measured") for what in step.PARAMETERS.values())


def count_line(rows: list[Row]) -> str:
    """'N independent points, K fitted or derived parameters', and what each parameter is."""
    independent = sum(r.role != DERIVED for r in rows)
    counted = [f"{name}={getattr(step, name)} ({what})" for name, what in step.PARAMETERS.items()
               if not what.startswith("measured")]
    measured = [f"{name} is {what}" for name, what in step.PARAMETERS.items() if what.startswith("measured")]
    return (f"{independent} independent points, {parameter_count()} fitted or derived parameters: "
            + ", ".join(counted) + "; " + ", ".join(measured) + ", not counted; the GEMM tile "
            f"({gemm.TILE[0]}×{gemm.TILE[1]}) and each GPU's SM count (labkit.sim.gemm) are assumed, not counted")


def _block(rows: list[Row], paper: str, header: list[str], line) -> list[str]:
    mine = [r for r in rows if r.paper == paper]
    targets = " / ".join(dict.fromkeys(r.target for r in mine))
    return ["", f"{paper}: {METRICS[paper]} — {targets}", *header] + [line(r) for r in mine]


def format_table(rows: list[Row] = None, eff=None, net=None, slow=None) -> str:
    """The in-sample validation table as plain text — a block per paper headed by its bar, a line per point with
    its role — and the constants it used (``rows`` computed with ``eff``/``net``/``slow`` when not given)."""
    rows = validation_table(eff, net, slow) if rows is None else rows
    e, n, c = constants(eff, net, slow)
    w = max(len(r.point) for r in rows)
    lines = ["labkit.sim — a model, against published runs (in sample: the constants fitted on these points)",
             f"constants: MATMUL_EFFICIENCY={e}, NETWORK_EFFICIENCY={n}, OVERLAP_COST={c}",
             f"  ({constants_source(e, n, c)})", count_line(rows)]
    header = [f"  {'point':{w}s} {'published':>9s} {'predicted':>9s} {'error':>8s}  held role"]

    def line(r: Row) -> str:
        return (f"  {r.point:{w}s} {r.published!s:>9s} {r.predicted!s:>9s} {error_text(r):>8s}  "
                f"{'yes' if r.held else 'NO':4s} {r.role}")
    for paper in dict.fromkeys(r.paper for r in rows):
        lines += _block(rows, paper, header, line)
    held = sum(r.held for r in rows)
    return wrap("\n".join(lines + ["", f"{held}/{len(rows)} points within their bar"]), indent="    ")


def _fold_lines(fold: Fold, in_sample: dict, w: int) -> list[str]:
    others = " and ".join(fold.fitted_on)
    lines = ["", f"held out: {fold.held_out} — fitted on {others}:",
             f"  MATMUL_EFFICIENCY={fold.eff}, NETWORK_EFFICIENCY={fold.net}"
             + (f"; the V100 at {fold.v100} (its own rate is derived from the held-out paper)" if fold.v100 else "")]
    header = [f"  {'':{w}s} {'':9s} {'in sample':>9s} {'held out':>9s}",
              f"  {'point':{w}s} {'published':>9s} {'error':>9s} {'predicted':>9s} {'error':>8s}  held role"]

    def line(r: Row) -> str:
        return (f"  {r.point:{w}s} {r.published!s:>9s} {error_text(in_sample[r.point]):>9s} {r.predicted!s:>9s} "
                f"{error_text(r):>8s}  {'yes' if r.held else 'NO':4s} {r.role}")
    lines += _block(list(fold.rows), fold.held_out, header, line)[2:]
    lines.append(f"  {_score(fold.rows)}")
    if fold.own_v100_rows:
        lines.append(f"  with the V100 at its derived rate instead (a number from the held-out paper): "
                     f"{_score(fold.own_v100_rows)}")
    return lines


def _score(rows) -> str:
    """'k/n independent points within their bar (worst b bars); k'/n' rows'."""
    points = [r for r in rows if r.role != DERIVED]
    return (f"{sum(r.held for r in points)}/{len(points)} independent points within their bar (worst "
            f"{max(r.bar_units for r in points):.2f} bars); {sum(r.held for r in rows)}/{len(rows)} rows")


def format_holdout(folds: list[Fold] = None, in_sample: list[Row] = None) -> str:
    """The leave-one-paper-out table: each paper's points predicted by the efficiencies fitted on the other two,
    the in-sample error beside each, and the totals out of sample and in sample."""
    folds = leave_one_paper_out() if folds is None else folds
    in_sample = validation_table() if in_sample is None else in_sample
    by_point = {r.point: r for r in in_sample}
    w = max(len(r.point) for r in in_sample)
    lines = ["Leave one paper out (out of sample): each paper predicted by the two efficiencies fitted, by the",
             f"same procedure, on the other two; a row is {HELD_OUT} unless {DERIVED} (in sample every row is",
             f"{FITTED} or {DERIVED})"]
    for fold in folds:
        lines += _fold_lines(fold, by_point, w)
    out = [r for fold in folds for r in fold.rows]
    lines += ["", f"out of sample: {_score(out)}", f"in sample:     {_score(in_sample)}"]
    return wrap("\n".join(lines), indent="    ")


def validation_text() -> str:
    """Both tables, in sample then out of sample: what ``labkit sim validate`` prints."""
    return format_table() + "\n\n" + format_holdout()
