"""Notebook 12's pictures and sentences: why long sequences need context parallelism, the ring step by step, the
causal imbalance of two splits, bytes beside their formulas, the three variants' times and the bug zoo.

Every measured number comes from a record of :func:`labkit.context_lab.run_lab` (a real run on cp gloo
processes) passed in; the memory picture is a model and says so. Figures are pure functions of their data.
"""
from __future__ import annotations

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.memory_estimate import activation_bytes_per_layer
from labkit.parallel.cp.bugs import BUGS
from labkit.parallel.cp.sharding import rank_work
from labkit.plots import FIGURE_WIDTH, label_axes, render_png
from labkit.text import wrap

# the model the memory picture sizes: a 32-layer, 4096-wide GPT with 32 heads, one sequence per micro-batch,
# attention recomputed (Korthikanti's selective recompute: no seq × seq scores kept), fp16 activations
LONG_MODEL = {"n_layer": 32, "hidden": 4096, "heads": 32, "micro_batch": 1}
CP_DEGREES = (1, 2, 4, 8, 16)
SEQ_LENS = tuple(2 ** k for k in range(12, 21))  # 4k … 1M tokens


def activation_gib(seq: int, cp: int, model: dict = LONG_MODEL) -> float:
    """Modelled activation memory per rank, GiB: Korthikanti's per-layer count (selective recompute) × layers ÷ cp."""
    per_layer = activation_bytes_per_layer(seq, model["micro_batch"], model["hidden"], model["heads"],
                                           recompute="selective", cp=cp)
    return per_layer * model["n_layer"] / 2**30


def cp_needed(seq: int, budget_gib: float, model: dict = LONG_MODEL) -> int | None:
    """The smallest cp of :data:`CP_DEGREES` whose activations per rank fit ``budget_gib`` (None if none does)."""
    return next((cp for cp in CP_DEGREES if activation_gib(seq, cp, model) <= budget_gib), None)


def memory_figure(seq: int, budget_gib: float) -> Figure:
    """Activation memory per rank against sequence length, one line per cp, the budget as a line, ``seq`` marked."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.4), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, cp in enumerate(CP_DEGREES):
        ax.plot(SEQ_LENS, [activation_gib(s, cp) for s in SEQ_LENS], marker="o", color=f"C{i}", label=f"cp = {cp}")
    ax.axhline(budget_gib, color="black", linestyle="--", label=f"{budget_gib:g} GiB for activations")
    ax.axvline(seq, color="grey", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    label_axes(ax, "activations per rank (modelled: Korthikanti's count ÷ cp)", "sequence length (tokens)", "GiB")
    ax.legend(fontsize=12, ncols=2)
    ax.tick_params(labelsize=12)
    return fig


def memory_text(seq: int, budget_gib: float) -> str:
    need = cp_needed(seq, budget_gib)
    one = activation_gib(seq, 1)
    head = (f"{seq:,} tokens: {one:,.1f} GiB of activations on one rank (modelled, a 32-layer 4096-wide GPT, "
            f"attention recomputed)")
    if need is None:
        return wrap(f"{head}; even cp = {CP_DEGREES[-1]} leaves {activation_gib(seq, CP_DEGREES[-1]):,.1f} GiB per "
                    f"rank, over {budget_gib:g} GiB: add tensor or pipeline parallelism, or recompute everything")
    return wrap(f"{head}; cp = {need} is the smallest degree that fits {budget_gib:g} GiB "
                f"({activation_gib(seq, need):,.1f} GiB per rank)")


class MemorySlider:
    """A sequence-length slider: the memory picture and the cp it forces (modelled)."""

    def __init__(self, budget_gib: float = 40.0):
        self.budget_gib = budget_gib
        self.slider = widgets.SelectionSlider(options=[(f"{s // 1024}k", s) for s in SEQ_LENS], value=2**16,
                                              description="sequence", layout=widgets.Layout(width="600px"))
        self.image, self.text = widgets.Image(format="png"), widgets.HTML()
        self.slider.observe(lambda change: self.draw(), names="value")
        self.draw()

    def draw(self) -> None:
        self.image.value = render_png(memory_figure(self.slider.value, self.budget_gib))
        self.text.value = f"<p style='font-size:16px'>{memory_text(self.slider.value, self.budget_gib)}</p>"

    def _ipython_display_(self):
        from IPython.display import display

        display(widgets.VBox([self.slider, self.text, self.image]))


# ---------------------------------------------------------------- the ring, from a real run

def ring_figure(lab: dict, layout: str = "head_tail") -> Figure:
    """Left: which rank's key/value block each rank held at each step. Right: each step's seconds computing on it
    and waiting for the next, per rank (the run's own clocks)."""
    timelines, cp = lab["timelines"][layout], lab["cp"]
    fig = Figure(figsize=(FIGURE_WIDTH, 1.4 + 0.7 * cp), dpi=100, layout="constrained")
    ax_grid, ax_time = fig.subplots(1, 2, width_ratios=(1, 1.6))
    for rank, steps in enumerate(timelines):
        for s in steps:
            ax_grid.add_patch(_cell(s["step"], rank, f"C{s['block']}"))
            ax_grid.text(s["step"] + 0.5, rank + 0.5, f"KV{s['block']}", ha="center", va="center", fontsize=13)
            left = sum(t["compute_s"] + t["wait_s"] for t in steps[:s["step"]]) * 1e3
            ax_time.barh(rank, s["compute_s"] * 1e3, left=left, color=f"C{s['block']}", edgecolor="black")
            ax_time.barh(rank, s["wait_s"] * 1e3, left=left + s["compute_s"] * 1e3, color="lightgrey",
                         edgecolor="black", hatch="//")
    ax_grid.set_xlim(0, cp)
    ax_grid.set_ylim(cp, 0)
    ax_grid.set_xticks([i + 0.5 for i in range(cp)], [str(i) for i in range(cp)], fontsize=12)
    ax_grid.set_yticks([r + 0.5 for r in range(cp)], [f"rank {r}" for r in range(cp)], fontsize=12)
    label_axes(ax_grid, "block in hand", "ring step", "", legend=False)
    ax_time.set_yticks(range(cp), [f"rank {r}" for r in range(cp)], fontsize=12)
    ax_time.set_ylim(cp - 0.5, -0.5)
    ax_time.tick_params(labelsize=12)
    label_axes(ax_time, "computing, then waiting (hatched)", f"ms (forward, {layout} chunks)", "", legend=False)
    return fig


def _cell(x: int, y: int, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, facecolor=color, edgecolor="black", alpha=0.6)


def imbalance_rows(lab: dict) -> list[dict]:
    """Per layout and rank: the causal work counted (blocks of scores the mask leaves) and the CPU seconds the ring
    measured, each over the mean of the ranks (1.0: a fair share)."""
    rows, cp = [], lab["cp"]
    for layout in ("contiguous", "head_tail"):
        work = [rank_work(r, cp, layout) for r in range(cp)]
        cpu = lab["cpu_s"][layout]
        for r in range(cp):
            rows.append({"layout": layout, "rank": r, "counted": work[r] / (sum(work) / cp),
                         "measured": cpu[r] / (sum(cpu) / cp)})
    return rows


def imbalance_figure(lab: dict) -> Figure:
    """Each rank's share of the causal work, counted and measured, under the contiguous and head-tail splits."""
    rows, cp = imbalance_rows(lab), lab["cp"]
    fig = Figure(figsize=(FIGURE_WIDTH, 4.0), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, layout in zip(axes, ("contiguous", "head_tail")):
        mine = [r for r in rows if r["layout"] == layout]
        ranks = [r["rank"] for r in mine]
        ax.bar([r - 0.2 for r in ranks], [r["counted"] for r in mine], width=0.4, label="counted (mask's FLOPs)")
        ax.bar([r + 0.2 for r in ranks], [r["measured"] for r in mine], width=0.4, label="measured (CPU clock)")
        ax.axhline(1.0, color="black", linestyle="--")
        ax.set_xticks(range(cp), [f"rank {r}" for r in range(cp)], fontsize=12)
        worst = max(r["counted"] for r in mine)
        label_axes(ax, f"{layout}: max {worst:.2f}× mean", "", "share of the mean")
        ax.tick_params(labelsize=12)
    return fig


def bytes_lines(lab: dict) -> list[str]:
    """Each variant's bytes one rank sent, counted at the collectives, beside the formula's."""
    lines = []
    for variant, ranks in lab["checks"].items():
        got, want = ranks[0]["bytes"], ranks[0]["expected"]
        same = all(r["bytes"] == r["expected"] for r in ranks)
        lines.append(f"{variant:10s} forward {got['forward']:>8,} B (formula {want['forward']:>8,}), backward "
                     f"{got['backward']:>8,} B (formula {want['backward']:>8,}): "
                     f"{'equal on every rank' if same else 'NOT equal'}")
    return lines


def times_lines(lab: dict) -> list[str]:
    """Each variant's forward + backward time (the slowest rank's), the median of its rounds, and every round."""
    ring = lab["median_s"]["ring"]
    return [f"{v:10s} {1e3 * lab['median_s'][v]:7.1f} ms median ({lab['median_s'][v] / ring:.2f}× the ring's) — "
            f"rounds: {', '.join(f'{1e3 * t:.1f}' for t in rounds)} ms" for v, rounds in lab["rounds_s"].items()]


def check_lines(lab: dict) -> list[str]:
    """Whether each variant's output and every gradient equal one rank's attention, on every rank."""
    return [f"{variant:10s} {'equal to one rank' if all(r['ok'] for r in ranks) else 'WRONG'} "
            f"(largest error {max(max(r['errors'].values()) for r in ranks):.1e})"
            for variant, ranks in lab["checks"].items()]


def bug_text(lab: dict, name: str) -> str:
    """What the check said with bug ``name`` switched on, rank by rank."""
    ranks = lab["bugs"][name]
    caught = not all(r["ok"] for r in ranks)
    worst = {k: max(r["errors"][k] for r in ranks) for k in ranks[0]["errors"]}
    errors = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    verdict = "CAUGHT: the check fails" if caught else "not caught: the check passes"
    return f"{name} — {BUGS[name]}.\n{verdict} (largest error per tensor: {errors})"


class BugZoo:
    """A switch over the zoo's bugs: what the gradient check said of each in the run."""

    def __init__(self, lab: dict):
        self.lab = lab
        self.choice = widgets.ToggleButtons(options=list(BUGS), description="bug",
                                            style={"button_width": "220px", "font_size": "14px"})
        self.out = widgets.HTML()
        self.choice.observe(lambda change: self.show(), names="value")
        self.show()

    def show(self) -> None:
        text = bug_text(self.lab, self.choice.value).replace("\n", "<br>")
        self.out.value = f"<p style='font-size:16px'>{text}</p>"

    def _ipython_display_(self):
        from IPython.display import display

        display(widgets.VBox([self.choice, self.out]))


def describe(lab: dict) -> str:
    return (f"cp = {lab['cp']} gloo processes on this machine, one sequence of {lab['seq']:,} tokens, "
            f"{lab['heads']} heads of {lab['head_dim']}, fp32")


__all__ = ["MemorySlider", "BugZoo", "memory_figure", "ring_figure", "imbalance_figure", "bytes_lines",
           "times_lines", "check_lines", "bug_text", "describe"]
