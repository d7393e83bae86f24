"""The modelled optimisation walk (:mod:`labkit.sim.optimize`) as text and as a figure, and the notebook's example.

The figure answers "where did the step's time go, and did the bottleneck move?": one bar per configuration the
walk kept, split into exposed communication, compute and the rest, with the flowchart's communication line.
Projector-sized: at most 9.5 inches wide, text at 12 pt or more. Every number is *modelled* and says so.
"""
from __future__ import annotations

from labkit.sim import step as step_model
from labkit.sim.cluster import cluster
from labkit.sim.optimize import EXPOSED_TERMS, ModelledWalk, Point, evaluate, optimize
from labkit.sim.scenario import CLUSTER, GPUS, SHAPE, find_baseline
from labkit.sim.step import Layout
from labkit.text import wrap
from labkit.tuning.flowchart import Decision, Thresholds

CHANGE_WIDTH = 30  # the table's "change" column: the longest override, attention.backend=labkit_flash

# the step's time terms in three groups (together: StepBreakdown.TIME_TERMS), with their colours
GROUPS = (("exposed communication", EXPOSED_TERMS, "#C44E52"),
          ("compute", ("compute", "recompute", "attention_memory", "elementwise_memory", "expert_imbalance"),
           "#4C72B0"),
          ("bubble, overlap slowdown", ("bubble", "overlap_slowdown"), "#CCB974"))


def describe_point(p: Point) -> str:
    """``dp 128 × tp 1 × pp 1, micro-batch 8 × 1, fp32, naive attention, ...`` for one point."""
    lay = p.layout
    extras = [f"gradients ÷{lay.grad_compression:.3g} on the wire" if lay.grad_compression != 1 else "",
              f"synchronised every {lay.sync_every} steps" if lay.sync_every > 1 else ""]
    return ", ".join([lay.axes, f"micro-batch {lay.micro_batch} × "
                      f"{lay.micro_batches}", p.precision, f"{lay.attention} attention"] + [e for e in extras if e])


def verdict(d: Decision) -> str:
    """kept, rejected (modelled and not faster, or known to be slower), skipped (not modelled), — (a note)."""
    if d.candidate is None:
        return "—"
    return "kept" if d.kept else "rejected" if d.trial or d.reason.startswith("rejected") else "skipped"


def change(d: Decision) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.candidate.overrides.items()) if d.candidate else "—"


def _row(d: Decision) -> str:
    m = d.trial or d.baseline
    numbers = (f"{m.tokens_per_s:>11,.0f} {100 * m.mfu:>5.1f}% {100 * m.comm_exposed_frac:>6.1f}%"
               if d.trial or d.candidate is None else f"{'':>11} {'':>6} {'':>7}")
    return f"{d.iteration:>3} {d.node:<20} {change(d):<{CHANGE_WIDTH}} {numbers}  {verdict(d)}\n      {d.reason}"


def format_walk(walk: ModelledWalk) -> str:
    """The walk as plain text: the start, one line per decision with its reason (wrapped to ``PRINT_WIDTH``),
    the best point."""
    s, t = walk.shape, walk.thresholds
    lines = [f"The optimisation flowchart on a simulated cluster — {walk.label}",
             f"model h{s.hidden} × {s.layers} layers × {s.heads} heads, seq {s.seq}, vocab {s.vocab}; "
             f"{walk.cluster.name}, {walk.cluster.gpus} GPUs",
             f"start: {describe_point(walk.start)}",
             "exposed communication = (tp + pp + dp exposed) / step; a change is kept at ≥ "
             f"{t.min_speedup:g}× the modelled tokens/s (the model has no loss to check)", "",
             f"{'#':>3} {'node':<20} {'change':<{CHANGE_WIDTH}} {'tokens/s':>11} {'MFU':>6} {'exposed':>7}  verdict"]
    lines += [_row(d) for d in walk.decisions]
    ceiling = step_model.gpu_matmul_efficiency(walk.cluster.gpu)
    if ceiling < t.utilization:
        lines += ["", f"note: the model's MFU cannot exceed its matmul efficiency ({ceiling:.0%}), below the "
                      f"flowchart's {t.utilization:.0%}: the utilization-ok branch is reached only with a lower "
                      "threshold"]
    lines += ["", f"best: {describe_point(walk.best)}",
              f"      {walk.best.measurement.tokens_per_s:,.0f} tokens/s, MFU {100 * walk.best.step.mfu:.1f}%, "
              f"{walk.speedup:.2f}× the start ({walk.label})"]
    return wrap("\n".join(lines), indent="      ")


def kept_points(walk: ModelledWalk) -> list[tuple[str, Point]]:
    """The start and each configuration the walk kept, replayed through the model, with what changed."""
    return [("start", walk.start)] + [(f"{d.iteration}. {change(d)}",
                                       evaluate(walk.shape, walk.start.layout, walk.cluster, d.trial.overrides))
                                      for d in walk.decisions if d.kept]


def walk_figure(walk: ModelledWalk, width: float | None = None):
    """Each kept configuration's step split into exposed communication, compute and the rest (% of the step),
    with the flowchart's communication line and the modelled tokens/s: the bottleneck moving."""
    from matplotlib.figure import Figure

    from labkit.plots import FIGURE_WIDTH, label_axes

    points = kept_points(walk)
    fig = Figure(figsize=(width or FIGURE_WIDTH, 1.9 + 0.62 * len(points)), dpi=100, layout="constrained")
    ax = fig.subplots()
    y = list(range(len(points)))[::-1]  # the start on top
    left = [0.0] * len(points)
    for name, terms, color in GROUPS:
        share = [100 * sum(getattr(p.step, term) for term in terms) / p.step.total for _, p in points]
        ax.barh(y, share, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, share)]
    line = 100 * walk.thresholds.comm_frac
    ax.axvline(line, color="black", linestyle="--", label=f"{line:.0f}%: communication-bound")
    for yi, (_, p) in zip(y, points):
        ax.text(101, yi, f"{p.measurement.tokens_per_s / 1e6:,.2f}M tokens/s", va="center", fontsize=12)
    ax.set_yticks(y, [label for label, _ in points], fontsize=12)
    ax.set_xlim(0, 100)
    ax.tick_params(labelsize=12)
    label_axes(ax, f"where the step goes — {walk.label}", "% of the modelled step", "", legend=False)
    ax.title.set_fontsize(12)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=12, loc="outside lower center", ncol=2)
    return fig


# ---------------------------------------------------------------- the notebook's example

def comm_bound_example(thresholds: Thresholds | None = None) -> ModelledWalk:
    """The source text's 128-GPU scenario (:mod:`labkit.sim.scenario`): GPT-2 small's shape, pure data parallelism
    in fp32 on DGX A100 nodes on 100 Gb/s Ethernet, at the scenario's baseline micro-batch (exposed communication
    over 35%, efficiency near the source's 58%): communication-bound."""
    base = find_baseline()
    if base is None:
        raise ValueError("the scenario finds no communication-bound baseline with the step model's constants")
    return optimize(SHAPE, Layout(dp=GPUS, micro_batch=base["micro_batch"]), cluster(CLUSTER, GPUS), "fp32",
                    thresholds)


def optimize_text(quick: bool = False) -> str:
    """The 128-GPU communication-bound walk as text (``quick`` is accepted for symmetry: the walk takes < 1 s)."""
    return format_walk(comm_bound_example())


def optimize_figure(quick: bool = False):
    """:func:`walk_figure` of the 128-GPU communication-bound walk."""
    return walk_figure(comm_bound_example())
