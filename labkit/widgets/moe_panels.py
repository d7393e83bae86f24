"""Notebook 13's pictures of a run's routing, drawn from its step events: each expert's load step by step as a heatmap,
max/mean load, the share dropped, and several runs side by side.

Every step event of a mixture-of-experts run carries, per MoE layer, the tokens routed to each expert
(``moe_load``, summed over the step's micro-batches and the data-parallel ranks), max/mean load (``moe_max_mean``)
and the share of assignments dropped over capacity (``moe_drop_rate``); :class:`labkit.callbacks.ExpertRouting`
puts them there. The figures here are pure functions of those events, so they are tested without a kernel, and
:func:`routing_figure` is drawn live by the dashboard's painter process (:mod:`labkit.widgets.painter`), which
imports this module: nothing here imports torch.
"""
from __future__ import annotations

from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.moe_lab import final_val_loss, mean_over_steps, routed_steps, worst_max_mean
from labkit.plots import FIGURE_WIDTH

FIGURE = "labkit.widgets.moe_panels:routing_figure"  # what the painter draws while a MoE run goes, by name
SHARE_CMAP = "RdBu_r"  # white at the fair share (1), red above it, blue below
TITLE, LABEL, TICK, LEGEND = 14, 12, 12, 12


def moe_blocks(steps: list[dict]) -> list[int]:
    """The blocks whose MLP is a mixture of experts, in the order the events list them."""
    return list(steps[0].get("moe_layers") or range(len(steps[0]["moe_load"]))) if steps else []


def load_shares(steps: list[dict], layer: int) -> list[list[float]]:
    """Layer ``layer``'s load of each expert at each step over that step's mean load: one row per expert, one
    column per step (1.0: the expert got its fair share; 0: none; E/k: every assignment)."""
    experts = len(steps[0]["moe_load"][layer]) if steps else 0
    columns = []
    for e in steps:
        load = e["moe_load"][layer]
        mean = sum(load) / len(load)
        columns.append([n / mean if mean else 0.0 for n in load])
    return [[column[i] for column in columns] for i in range(experts)]


def share_scale(runs: list[list[dict]]) -> float:
    """The heatmaps' top: at least 2 (twice the fair share), or the largest share any run reached."""
    top = max((max(max(row) for row in load_shares(steps, layer))
               for steps in runs if steps for layer in range(len(steps[0]["moe_load"]))), default=2.0)
    return max(2.0, top)


def heatmap(ax, steps: list[dict], layer: int, vmax: float, title: str):
    """One layer's load shares as a heatmap: experts up the side, steps along the bottom."""
    shares = load_shares(steps, layer)
    first, last = steps[0]["step"], steps[-1]["step"]
    image = ax.imshow(shares, aspect="auto", origin="lower", cmap=SHARE_CMAP, interpolation="nearest",
                      norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
                      extent=(first - 0.5, last + 0.5, -0.5, len(shares) - 0.5))
    ax.set_title(title, fontsize=LABEL + 1)
    ax.set_ylabel("expert", fontsize=LABEL)
    ax.yaxis.set_major_locator(MaxNLocator(min(len(shares), 8), integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    ax.tick_params(labelsize=TICK)
    return image


def _colorbar(fig: Figure, image) -> None:
    """The heatmaps' one colour scale, beside them all."""
    bar = fig.colorbar(image, ax=fig.axes, location="right", shrink=0.9, pad=0.01)
    bar.set_label("load ÷ mean", fontsize=LABEL)
    bar.ax.tick_params(labelsize=TICK)


def _waiting(fig: Figure, text: str) -> Figure:
    ax = fig.subplots()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=LABEL + 2, color="gray", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def _style(ax, title: str, ylabel: str, xlabel: str = "step") -> None:
    ax.set_title(title, fontsize=LABEL + 1)
    ax.set_ylabel(ylabel, fontsize=LABEL)
    ax.set_xlabel(xlabel, fontsize=LABEL)
    ax.tick_params(labelsize=TICK)
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    ax.grid(alpha=0.3)


def routing_figure(events: list[dict], title: str = "") -> Figure:
    """A MoE run as it goes: each MoE layer's load per expert over the steps (a heatmap of load ÷ mean), then the
    training loss, each layer's max/mean load and the share of assignments dropped over capacity."""
    steps = routed_steps(events)
    blocks = moe_blocks(steps)
    fig = Figure(figsize=(FIGURE_WIDTH, 2.4 + 1.9 * max(1, len(blocks))), dpi=100, layout="constrained")
    if not steps:
        return _waiting(fig, "no routed step yet: a dense GPT, or the run has not stepped")
    grid = fig.add_gridspec(len(blocks) + 1, 3, height_ratios=[1.0] * len(blocks) + [1.25])
    vmax = share_scale([steps])
    image = None
    for i, block in enumerate(blocks):
        ax = fig.add_subplot(grid[i, :])
        image = heatmap(ax, steps, i, vmax, f"block {block}: each expert's load ÷ the mean load")
    _colorbar(fig, image)
    x = [e["step"] for e in steps]
    ax_loss, ax_max, ax_drop = (fig.add_subplot(grid[-1, j]) for j in range(3))
    ax_loss.plot(x, [e["loss"] for e in steps], lw=1.5)
    _style(ax_loss, "training loss", "nats/token")
    for i, block in enumerate(blocks):
        ax_max.plot(x, [e["moe_max_mean"][i] for e in steps], lw=1.5, label=f"block {block}")
        drops = [e["moe_drop_rate"][i] for e in steps]
        ax_drop.plot(x, [100 * (d or 0.0) for d in drops], lw=1.5, label=f"block {block}")
    ax_max.axhline(1.0, color="black", ls="--", lw=1)
    _style(ax_max, "max/mean load (1: even)", "max ÷ mean")
    _style(ax_drop, "dropped (over capacity)", "% of assignments")
    top = max((100 * (d or 0.0) for e in steps for d in e["moe_drop_rate"]), default=0.0)
    ax_drop.set_ylim(0, max(1.0, 1.2 * top))
    if len(blocks) > 1:
        ax_max.legend(fontsize=LEGEND)
    start = next((e for e in events if e.get("type") == "start"), {})
    fig.suptitle(title or f"routing, step {steps[-1]['step'] + 1} of {start.get('steps', '?')}", fontsize=TITLE)
    return fig


def balance_figure(runs: dict[str, list[dict]], title: str = "") -> Figure:
    """Runs that differ only in how they balance, side by side: each one's load heatmap per MoE layer (one colour
    scale for all), then every run's max/mean load (the worst layer's) over the steps and the validation loss each
    reached (its last evaluation: the language-model loss alone, no auxiliary term)."""
    named = {name: routed_steps(events) for name, events in runs.items()}
    blocks = moe_blocks(next(iter(named.values()), []))
    fig = Figure(figsize=(FIGURE_WIDTH, 2.9 + 1.9 * max(1, len(blocks))), dpi=100, layout="constrained")
    if not blocks:
        return _waiting(fig, "no routed steps in these runs")
    grid = fig.add_gridspec(len(blocks) + 1, len(named), height_ratios=[1.0] * len(blocks) + [1.5])
    vmax = share_scale(list(named.values()))
    image = None
    for j, (name, steps) in enumerate(named.items()):
        for i, block in enumerate(blocks):
            ax = fig.add_subplot(grid[i, j])
            image = heatmap(ax, steps, i, vmax, f"{name}: block {block}")
            if j:
                ax.set_ylabel("")
    _colorbar(fig, image)
    bottom = grid[-1, :].subgridspec(1, 2, width_ratios=(1.6, 1))
    ax_max, ax_val = fig.add_subplot(bottom[0]), fig.add_subplot(bottom[1])
    for j, (name, steps) in enumerate(named.items()):
        ax_max.plot([e["step"] for e in steps], [worst_max_mean(e) for e in steps], lw=1.5, color=f"C{j}",
                    label=name)
    ax_max.axhline(1.0, color="black", ls="--", lw=1)
    _style(ax_max, "max/mean load, worst layer (1: even)", "max ÷ mean")
    ax_max.legend(fontsize=LEGEND, ncols=min(3, len(named)))
    ax_max.set_ylim(bottom=0.9, top=ax_max.get_ylim()[1] * 1.25)  # room for the legend
    finals = {name: final_val_loss(events) for name, events in runs.items()}
    names = list(finals)
    ax_val.bar(range(len(names)), [v or 0.0 for v in finals.values()], color=[f"C{j}" for j in range(len(names))])
    for j, v in enumerate(finals.values()):
        ax_val.text(j, v or 0.0, "n/a" if v is None else f"{v:.3f}", ha="center", va="bottom", fontsize=LABEL)
    low = min((v for v in finals.values() if v is not None), default=0.0)
    high = max((v for v in finals.values() if v is not None), default=1.0)
    ax_val.set_ylim(max(0.0, low - 0.6 * (high - low + 0.05)), high + 0.5 * (high - low + 0.05))
    _style(ax_val, "validation loss at the end", "nats/token", xlabel="")
    ax_val.set_xticks(range(len(names)), names, fontsize=TICK)
    if title:
        fig.suptitle(title, fontsize=TITLE)
    return fig


__all__ = ["FIGURE", "routing_figure", "balance_figure", "load_shares", "routed_steps", "worst_max_mean",
           "final_val_loss", "mean_over_steps"]
