"""The FlashAttention lab: the online softmax step by step, and what each attention kernel costs.

``OnlineSoftmaxExplorer`` walks one row of attention scores through the online softmax a block at
a time (``labkit.model.flash.online_softmax_steps``): the running max, the running sum and the
rescaling of everything seen so far, ending exactly at the ordinary softmax.
``labkit.model.attention.attention_costs`` measures, in this process, forward+backward time and the bytes each backend
saves for backward — the (seq × seq) matrix the naive kernel keeps and FlashAttention never does.
"""
from __future__ import annotations

import ipywidgets as W
import torch
from matplotlib.figure import Figure

from labkit.model.flash import online_softmax_steps
from labkit.plots import FIGURE_WIDTH, label_axes, render_png
from labkit.text import wrap

# one look per backend, so that two backends with equal numbers both show: the first drawn wide and hollow, the next
# narrower inside it, dashed
STYLES = ({"marker": "o", "ms": 13, "mfc": "none", "mew": 2, "ls": "-", "lw": 3},
          {"marker": "s", "ms": 8, "ls": "--", "lw": 2},
          {"marker": "^", "ms": 6, "ls": ":", "lw": 2})


def rescale_text(step: dict) -> str:
    """What a block did to the terms summed before it: nothing on the first block (there are none), kept them when
    the running max did not grow (× 1), else multiplied them by exp(m_old − m_new) < 1."""
    if step["start"] == 0:
        return "first block: nothing earlier to rescale"
    if step["rescale"] == 1.0:
        return "max unchanged: earlier terms kept (× 1)"
    return f"max grew: earlier terms × {step['rescale']:.3f}"


def step_line(step: dict) -> str:
    """One block of the online softmax as a printed line: its keys, the running max and sum, the rescaling."""
    return (f"keys {step['start']:2d}-{step['stop'] - 1:2d}: m = {step['max']:6.3f}  l = {step['sum']:6.3f}  "
            f"{rescale_text(step)}")


def softmax_step_figure(scores: torch.Tensor, steps: list[dict], index: int) -> Figure:
    """Top: the row's scores, the blocks seen so far and the running max. Below: the softmax as known after this
    block, against the true softmax of the whole row."""
    step = steps[index]
    fig = Figure(figsize=(FIGURE_WIDTH, 6.6), dpi=100, layout="constrained")
    ax_scores, ax_probs = fig.subplots(2, 1, sharex=True)
    x = list(range(scores.numel()))
    colors = ["#4C72B0" if i < step["start"] else "#DD8452" if i < step["stop"] else "#DDDDDD" for i in x]
    ax_scores.bar(x, scores.tolist(), color=colors)
    ax_scores.axhline(step["max"], ls="--", color="#C44E52", label=f"running max m = {step['max']:.3f}")
    ax_scores.set_title("Scores: seen (blue), this block (orange), not yet (grey)", fontsize=14)
    ax_scores.legend(fontsize=12)
    ax_probs.bar(x, step["probs"].tolist(), color="#55A868", label="softmax so far")
    ax_probs.plot(x, torch.softmax(scores.double(), -1).tolist(), "k_", markersize=14, label="true softmax")
    ax_probs.set_title(f"Block {index + 1}/{len(steps)}: sum l = {step['sum']:.3f}; {rescale_text(step)}",
                       fontsize=14)
    ax_probs.legend(fontsize=12)
    ax_probs.set_xlabel("key position", fontsize=12)
    for ax in (ax_scores, ax_probs):
        ax.tick_params(labelsize=12)
        ax.grid(axis="y", alpha=0.3)
    return fig


class OnlineSoftmaxExplorer:
    """A tile-size slider and a step slider over one row of random attention scores."""

    def __init__(self, seq: int = 16, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.scores = torch.randn(seq, generator=generator) * 2
        style, layout = {"description_width": "120px"}, W.Layout(width="420px")
        self.block = W.IntSlider(4, min=1, max=seq, description="tile size", style=style, layout=layout)
        self.step = W.IntSlider(0, min=0, max=0, description="block", style=style, layout=layout)
        self.text = W.HTML()
        self.picture = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.block.observe(self._on_block, names="value")
        self.step.observe(lambda _: self.draw(), names="value")
        self._on_block()

    def _on_block(self, change=None) -> None:
        self.steps = online_softmax_steps(self.scores, self.block.value)
        self.step.max = len(self.steps) - 1
        self.step.value = min(self.step.value, self.step.max)
        self.draw()

    def draw(self) -> None:
        step = self.steps[self.step.value]
        done = self.step.value == len(self.steps) - 1
        exact = torch.allclose(step["probs"].double(), torch.softmax(self.scores.double(), -1))
        self.text.value = (f"<div style='font-size:1.15em'>keys {step['start']}–{step['stop'] - 1}: m = "
                           f"{step['max']:.4f}, l = {step['sum']:.4f}; {rescale_text(step)}"
                           f"{' — equal to the softmax of the whole row' if done and exact else ''}</div>")
        self.picture.value = render_png(softmax_step_figure(self.scores, self.steps, self.step.value))

    def widget(self) -> W.Widget:
        return W.VBox([self.block, self.step, self.text, self.picture])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


def equal_to(rows: list[dict], key: str) -> dict[str, str]:
    """For each backend whose ``key`` equals an earlier backend's at every sequence length: that backend's name
    (drawn on top of each other, they would look like one line)."""
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(r["backend"], []).append((r["seq"], r[key]))
    same, names = {}, list(series)
    for i, name in enumerate(names):
        earlier = next((other for other in names[:i] if series[other] == series[name]), None)
        if earlier is not None:
            same[name] = earlier
    return same


def attention_costs_figure(rows: list[dict]) -> Figure:
    """Forward + backward time and the bytes saved for backward per backend against sequence length; a backend
    equal to another is drawn inside it and labelled so."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.6), dpi=100, layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2)
    same = equal_to(rows, "saved_bytes")
    for i, backend in enumerate(dict.fromkeys(r["backend"] for r in rows)):
        mine = [r for r in rows if r["backend"] == backend]
        seqs, style = [r["seq"] for r in mine], {**STYLES[i % len(STYLES)], "color": f"C{i}"}
        ax_time.plot(seqs, [1e3 * r["time_s"] for r in mine], label=backend, **style)
        label = f"{backend} (= {same[backend]})" if backend in same else backend
        ax_mem.plot(seqs, [r["saved_bytes"] / 2**20 for r in mine], label=label, **style)
    for ax, title, ylabel in ((ax_time, "forward + backward time", "ms"),
                              (ax_mem, "memory saved for backward", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        label_axes(ax, title, "sequence length", ylabel)
        ax.tick_params(labelsize=12)
    return fig


def equal_memory_text(rows: list[dict]) -> str:
    """A sentence for each backend that saves exactly what another saves (empty when none does)."""
    return wrap("\n".join(f"{backend} saves exactly what {other} saves at every sequence length: the chart draws "
                          f"its line inside {other}'s" for backend, other in equal_to(rows, "saved_bytes").items()))
