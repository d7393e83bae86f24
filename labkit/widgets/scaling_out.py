"""The scaling-out lab: a published model on a catalog cluster, any layout, through :mod:`labkit.sim`'s step model.

Everything this lab draws is *modelled* (arithmetic from the α–β network model, exact FLOP counts and the memory
formulas), never measured; each figure and text says so. The dry run (:func:`dry_run_text`) is the one exception:
labkit's real code on torch's fake process group, whose bytes are real and whose times do not exist.
Projector-sized figures: at most 9.5 inches wide at 100 dpi, text at 12 pt or more.
"""
from __future__ import annotations

import dataclasses
from html import escape
from pathlib import Path
from typing import Optional

import ipywidgets as W
from matplotlib.figure import Figure

from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS
from labkit.plots import FIGURE_WIDTH, label_axes, render_png
from labkit.sim.cluster import CLUSTERS, cluster
from labkit.sim.layout import ATTENTION, RECOMPUTE, Layout, ModelShape, StepBreakdown
from labkit.sim.step import step_time

MODELLED = "modelled, not measured"
# Published shapes (hidden, layers, heads, seq, vocab): Brown et al. 2020; Shoeybi et al. 2019; Smith et al. 2022
# (MT-NLG); Narayanan et al. 2021's 1T; labkit's configs/quickstart.yaml (character vocabulary of tiny Shakespeare).
MODELS = {"GPT-3 175B": ModelShape(12288, 96, 96, 2048, 51200),
          "Megatron 8.3B": ModelShape(3072, 72, 32, 1024, 51200),
          "MT-NLG 530B": ModelShape(20480, 105, 128, 2048, 51200),
          "Megatron 1T": ModelShape(25600, 128, 160, 2048, 51200),
          "labkit quickstart": ModelShape(64, 2, 4, 64, 65)}
COLORS = {"compute": "#4C72B0", "recompute": "#64B5CD", "attention_memory": "#DA8BC3",
          "elementwise_memory": "#F1A7D6", "tp_comm": "#8172B3", "cp_comm": "#B47CC7", "ep_comm": "#6B4C9A",
          "expert_imbalance": "#A1C9F4",
          "pp_comm": "#937860", "bubble": "#CCB974", "dp_comm_exposed": "#C44E52", "overlap_slowdown": "#8C8C8C"}
MEMORY = [("memory_parameters", "parameters", "#4C72B0"), ("memory_gradients", "gradients", "#DD8452"),
          ("memory_optimizer", "optimizer", "#55A868"), ("memory_activations", "activations", "#8C8C8C")]
QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _fonts(ax) -> None:
    ax.tick_params(labelsize=12)


def breakdown_figure(b: StepBreakdown, title: str = "") -> Figure:
    """Left: the step time, one stacked bar of its terms (ms). Right: memory per GPU, stacked, beside the GPU's."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.6), dpi=100, layout="constrained")
    ax_t, ax_m = fig.subplots(1, 2)
    bottom = 0.0
    for attr, name in b.TIME_TERMS:
        ms = 1e3 * getattr(b, attr)
        ax_t.bar([0], [ms], bottom=bottom, color=COLORS[attr], label=f"{name} {100 * getattr(b, attr) / b.total:.0f}%")
        bottom += ms
    ax_t.set_xticks([0], ["one step"])
    label_axes(ax_t, f"step time ({MODELLED})", "", "ms", legend=False)
    ax_t.legend(fontsize=12, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bottom = 0.0
    for attr, name, color in MEMORY:
        gb = getattr(b, attr) / 1e9
        ax_m.bar([0], [gb], bottom=bottom, color=color, label=name)
        bottom += gb
    ax_m.axhline(b.gpu_memory / 1e9, color="black", linestyle="--", label=f"GPU {b.gpu_memory / 1e9:.0f} GB")
    ax_m.set_xticks([0], ["fits" if b.fits else "does NOT fit"])
    label_axes(ax_m, "memory per GPU", "", "GB", legend=False)
    ax_m.legend(fontsize=12, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (ax_t, ax_m):
        _fonts(ax)
    if title:
        fig.suptitle(title, fontsize=14)
    return fig


def gpu_sweep(shape: ModelShape, layout: Layout, cluster_name: str, gpus: list[int],
              precision: str = "bf16") -> list[dict]:
    """``layout`` (its tp, pp and per-replica batch) data-parallel over each GPU count: the modelled exposed DP
    communication share and the scaling efficiency, per-GPU throughput ÷ that at the first count."""
    rows, first = [], None
    for g in gpus:
        lay = dataclasses.replace(layout, dp=g // (layout.tp * layout.pp))
        s = step_time(shape, lay, cluster(cluster_name, g), precision)
        per_gpu = s.model_flops / s.total / s.gpus
        first = first or per_gpu
        rows.append({"gpus": g, "efficiency": per_gpu / first, "exposed_share": s.dp_comm_exposed / s.total,
                     "comm_share": (s.tp_comm + s.pp_comm + s.dp_comm_exposed) / s.total, "label": MODELLED})
    return rows


def sweep_figure(rows: list[dict], title: str = "") -> Figure:
    """Scaling efficiency and exposed DP communication share against GPUs, with the source text's two lines."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    x = [r["gpus"] for r in rows]
    ax.plot(x, [100 * r["efficiency"] for r in rows], "o-", color="#4C72B0", label="scaling efficiency")
    ax.plot(x, [100 * r["exposed_share"] for r in rows], "s-", color="#C44E52", label="exposed dp comm share")
    ax.axhline(100 * SCALING_HOLDS, color="#55A868", linestyle="--", label=f"{100 * SCALING_HOLDS:.0f}%: scaling holds")
    ax.axhline(100 * SCALING_COLLAPSES, color="#C44E52", linestyle=":",
               label=f"{100 * SCALING_COLLAPSES:.0f}%: scaling collapses")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(g) for g in x])
    ax.set_ylim(0, 105)
    label_axes(ax, title or f"scaling out ({MODELLED})", "GPUs", "% (of step time / of first point)", legend=False)
    ax.legend(fontsize=12, loc="center left")
    _fonts(ax)
    return fig


def validation_text(matmul_efficiency=None, network_efficiency=None, overlap_cost=None) -> str:
    """The model against the published runs (:func:`labkit.sim.validate.validation_table`), misses included; the
    model's constants unless others are given."""
    from labkit.sim.validate import format_table

    return format_table(None, matmul_efficiency, network_efficiency, overlap_cost)


def dry_run_text(quick: bool = True) -> str:
    """labkit's real step for rank 0 of 64 (quick) or 1,024 ranks on torch's fake process group: its collectives."""
    from labkit.config import load_config
    from labkit.sim.dryrun import dry_run, format_result

    world = 64 if quick else 1024
    cfg = load_config(QUICKSTART, {"data.micro_batch_size": 1, "parallel.dp.strategy": "zero2",
                                   "data.batch_size": world})
    return format_result(dry_run(cfg, world))


def layout_problems(shape: ModelShape, gpus: int, tp: int, pp: int, gpus_available: int) -> list[str]:
    """Why a layout cannot be modelled, one sentence each (empty when it can)."""
    found = []
    if gpus % (tp * pp):
        found.append(f"tp × pp = {tp * pp} does not divide {gpus} GPUs: "
                     f"data parallelism needs a whole number of replicas")
    if gpus > gpus_available:
        found.append(f"{gpus} GPUs asked for, the cluster has {gpus_available}")
    if shape.heads % tp:
        found.append(f"{shape.heads} attention heads cannot be split {tp} ways (tp must divide the heads)")
    if pp > shape.layers:
        found.append(f"{pp} pipeline stages for {shape.layers} layers: a stage needs at least one layer")
    return found


class ScalingOutLab:
    """Dropdowns and sliders for a model, a cluster and a layout; the modelled breakdown redrawn on each change."""

    def __init__(self, model: str = "GPT-3 175B", cluster_name: str = "dgx-a100"):
        style = {"description_width": "120px"}  # the longest label, "micro-batches", whole
        dd = lambda desc, options, value: W.Dropdown(description=desc, options=options, value=value,  # noqa: E731
                                                     style=style)
        powers = [2 ** k for k in range(12)]
        self.model = dd("model", list(MODELS), model)
        self.cluster = dd("cluster", list(CLUSTERS), cluster_name)
        self.gpus = dd("GPUs", powers, 64)
        self.tp = dd("tp", powers[:7], 8)
        self.pp = dd("pp", powers[:8], 8)
        self.micro_batches = W.IntSlider(description="micro-batches", min=1, max=128, value=64, style=style)
        self.zero = dd("ZeRO", [0, 1, 2, 3], 1)
        self.recompute = dd("recompute", list(RECOMPUTE), "selective")
        self.sequence_parallel = W.Checkbox(description="sequence parallel", value=True)
        self.attention = dd("attention", list(ATTENTION), "naive")
        self.precision = dd("precision", ["bf16", "fp16", "fp32"], "bf16")
        self.status, self.text = W.HTML(), W.HTML()
        self.image = W.Image(format="png")
        self.breakdown: Optional[StepBreakdown] = None
        for w in self.controls:
            w.observe(self._on_change, names="value")
        self._on_change()

    @property
    def controls(self) -> list[W.Widget]:
        return [self.model, self.cluster, self.gpus, self.tp, self.pp, self.micro_batches, self.zero,
                self.recompute, self.sequence_parallel, self.attention, self.precision]

    def layout(self) -> Layout:
        return Layout(dp=self.gpus.value // (self.tp.value * self.pp.value), tp=self.tp.value, pp=self.pp.value,
                      micro_batches=self.micro_batches.value, zero=self.zero.value, recompute=self.recompute.value,
                      sequence_parallel=self.sequence_parallel.value, attention=self.attention.value)

    def problems(self) -> list[str]:
        c = cluster(self.cluster.value)
        return layout_problems(MODELS[self.model.value], self.gpus.value, self.tp.value, self.pp.value, c.gpus)

    def _on_change(self, change=None) -> None:
        problems = self.problems()
        if problems:
            self.breakdown = None
            self.status.value = ("<b style='color:#b00'>Cannot model this layout:</b><br>"
                                 + "<br>".join(escape(p) for p in problems))
            return
        shape, lay = MODELS[self.model.value], self.layout()
        c = cluster(self.cluster.value, self.gpus.value)
        try:
            self.breakdown = step_time(shape, lay, c, self.precision.value)
        except ValueError as err:  # e.g. a precision the GPU has no published peak for
            self.breakdown = None
            self.status.value = f"<b style='color:#b00'>Cannot model this layout:</b> {escape(str(err))}"
            return
        b = self.breakdown
        self.status.value = (f"✓ dp={lay.dp} × tp={lay.tp} × pp={lay.pp} on {c.nodes} node(s) of {c.name}: "
                             f"step {1e3 * b.total:.0f} ms, MFU {100 * b.mfu:.1f}% ({MODELLED})")
        self.text.value = f"<pre style='font-size:0.95em'>{escape(b.describe())}</pre>"
        title = f"{self.model.value} on {c.name}, dp {lay.dp} × tp {lay.tp} × pp {lay.pp}"
        self.image.value = render_png(breakdown_figure(b, title))

    def sweep(self, gpus: Optional[list[int]] = None) -> list[dict]:
        """The current layout's tp, pp and per-replica batch over more and more replicas."""
        split = self.tp.value * self.pp.value
        c = cluster(self.cluster.value)
        gpus = gpus or [split * 2 ** k for k in range(12) if split * 2 ** k <= c.gpus]
        return gpu_sweep(MODELS[self.model.value], self.layout(), self.cluster.value, gpus, self.precision.value)

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML(f"<h3>Scaling out ({MODELLED})</h3>"), *self.controls, self.status, self.image,
                       self.text])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
