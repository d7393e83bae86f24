"""A memory calculator widget over :mod:`labkit.memory_estimate`: what fits on one GPU, and why.

Laid out for a notebook's output area (about 968 px, ``labkit.plots.OUTPUT_WIDTH_PX``): the controls in a grid of
columns that wraps to fewer columns when the area is narrower, then the table, then the bars across the width.
"""
from __future__ import annotations


import ipywidgets as W
from matplotlib.figure import Figure

from labkit.memory_estimate import PRESETS, estimate_memory, format_bytes
from labkit.plots import FIGURE_WIDTH, render_png

PARTS = [("parameters", "#4C72B0"), ("gradients", "#DD8452"), ("optimizer_state", "#55A868"),
         ("activations", "#8172B3")]


def memory_figure(breakdown, title: str) -> Figure:
    fig = Figure(figsize=(FIGURE_WIDTH, 2.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    left = 0.0
    for name, color in PARTS:
        value = (getattr(breakdown, name) or 0.0) / 1e9
        ax.barh([0], [value], left=left, color=color, label=name.replace("_", " "))
        left += value
    ax.set_yticks([])
    ax.tick_params(axis="x", labelsize=12)
    ax.set_xlabel("GB per GPU", fontsize=12)
    ax.set_title(title, fontsize=13)
    ax.legend(ncol=4, fontsize=12, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    return fig


class MemoryCalculator:
    """Pick a preset and a parallel layout; see the per-GPU memory split, recomputed on every change."""

    def __init__(self, preset: str = "zero-paper-7.5b"):
        style, layout = {"description_width": "130px"}, W.Layout(width="auto")  # the grid's column sets the width
        self.preset = W.Dropdown(options=list(PRESETS), value=preset, description="model", style=style, layout=layout)
        self.precision = W.Dropdown(options=["mixed", "fp32"], value="mixed", description="precision", style=style,
                                    layout=layout)
        self.dp = W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], value=64,
                             description="data parallel", style=style, layout=layout)
        self.zero_stage = W.ToggleButtons(options=[0, 1, 2, 3], value=0, description="ZeRO stage",
                                          style={**style, "button_width": "auto"})
        self.tp = W.Dropdown(options=[1, 2, 4, 8], value=1, description="tensor parallel", style=style, layout=layout)
        self.pp = W.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="pipeline parallel", style=style,
                             layout=layout)
        self.micro_batch = W.IntSlider(1, min=1, max=32, description="micro-batch", style=style, layout=layout)
        self.recompute = W.Dropdown(options=["none", "selective", "full"], value="none", description="recompute",
                                    style=style, layout=layout)
        self.table = W.HTML()
        self.picture = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.breakdown = None
        for control in self.controls:
            control.observe(lambda _: self.update(), names="value")
        self.update()

    @property
    def controls(self):
        return [self.preset, self.precision, self.dp, self.zero_stage, self.tp, self.pp, self.micro_batch,
                self.recompute]

    def update(self) -> None:
        plan = PRESETS[self.preset.value]
        try:
            self.breakdown = estimate_memory(plan, precision=self.precision.value, dp=self.dp.value,
                                             zero_stage=self.zero_stage.value, tp=self.tp.value, pp=self.pp.value,
                                             micro_batch=self.micro_batch.value, recompute=self.recompute.value)
        except ValueError as error:
            self.table.value = f"<div style='color:#b00020;font-size:1.1em'><b>Not possible:</b> {error}</div>"
            return
        b = self.breakdown
        cells = [(name.replace("_", " "), getattr(b, name)) for name, _ in PARTS] + [("total", b.total)]
        rows = "".join(f"<tr><td>{name}</td><td style='text-align:right;padding-left:2em'>"
                       f"{'n/a' if value is None else format_bytes(value)}</td></tr>" for name, value in cells)
        self.table.value = f"<table style='font-size:1.15em'>{rows}</table>"
        title = f"{self.preset.value}: {self.breakdown.total / 1e9:.1f} GB per GPU"
        self.picture.value = render_png(memory_figure(self.breakdown, title))

    def widget(self) -> W.Widget:
        controls = W.GridBox(self.controls, layout=W.Layout(
            grid_template_columns="repeat(auto-fill, minmax(340px, 1fr))", grid_gap="4px 16px", width="100%"))
        return W.VBox([W.HTML("<h3>Memory per GPU</h3>"), controls, self.table, self.picture],
                      layout=W.Layout(width="100%"))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
