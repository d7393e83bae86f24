"""Notebook 13's widgets, pictures and sentences: a router explored in this process, tokens dropped against the
capacity factor, runs that differ only in their balancing, the all-to-all of expert parallelism with its bytes, and
the scaling trade a dense and a MoE GPT of the same active compute make.

Where each number comes from is said with it: the explorer and the drop curve count what labkit's router functions
do to a fixed routing (:func:`labkit.moe_lab.route`, :func:`labkit.moe_lab.drop_curve`); the run pictures read real
runs' step events (:mod:`labkit.widgets.moe_panels`); the bytes are counted at the collectives, beside a balanced
formula labelled as one; the scaling trade is rendered from ``benchmarks/results/moe.jsonl``. Figures are pure
functions of their data.
"""
from __future__ import annotations

import math
from typing import Optional

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from labkit.moe_lab import EXPERTS, TOP_K, balanced_drop, mean_over_steps, route, routed_steps
from labkit.plots import FIGURE_WIDTH, label_axes, render_png
from labkit.text import wrap
from labkit.widgets.moe_panels import FIGURE as ROUTING_FIGURE  # noqa: F401 — the live run's dashboard picture
from labkit.widgets.moe_panels import balance_figure  # noqa: F401 — the balancing runs' picture

KEPT, DROPPED, FAIR, CAPACITY = "#4C72B0", "#C44E52", "#555555", "#DD8452"


def _bytes(n: Optional[float]) -> str:
    """A byte count a room reads at a glance, four figures or so: B, kB or MB (powers of 1,000)."""
    if n is None:
        return "n/a"
    for unit, scale in (("MB", 1e7), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / (scale if unit == 'kB' else 1e6):,.0f} {unit}"
    return f"{n:,.0f} B"


# ---------------------------------------------------------------- the explorer: one forward's routing


def explorer_figure(routed: dict) -> Figure:
    """Assignments per expert of one forward: what each took (solid) and dropped over capacity (hatched), the
    capacity C and the fair share k·T/E as lines."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    experts = range(routed["experts"])
    ax.bar(experts, routed["kept"], color=KEPT, label="taken")
    ax.bar(experts, routed["dropped"], bottom=routed["kept"], color="white", edgecolor=DROPPED, hatch="//",
           label="dropped (over capacity)")
    fair = routed["top_k"] * routed["tokens"] / routed["experts"]
    ax.axhline(fair, color=FAIR, ls=":", lw=2, label=f"fair share k·T/E = {fair:g}")
    if routed["capacity"] is not None:
        ax.axhline(routed["capacity"], color=CAPACITY, ls="--", lw=2, label=f"capacity C = {routed['capacity']}")
    ax.set_xticks(list(experts), [str(e) for e in experts], fontsize=12)
    ax.set_ylim(0, 1.3 * max(max(routed["load"]), routed["capacity"] or 0, fair))
    factor = "dropless" if routed["factor"] is None else f"capacity factor {routed['factor']:g}"
    label_axes(ax, f"{routed['tokens']} tokens, top-{routed['top_k']} of {routed['experts']} experts, {factor}",
               "expert", "assignments", legend=False)
    ax.legend(fontsize=12, ncols=2, loc="upper right")
    ax.tick_params(labelsize=12)
    return fig


def explorer_text(routed: dict) -> str:
    """What the explorer's forward did, in sentences: the capacity's formula with its numbers, the drops, the load's
    spread, the auxiliary loss the Switch Transformer would add, and the bias where it moved."""
    k, t, e, f = routed["top_k"], routed["tokens"], routed["experts"], routed["factor"]
    if routed["capacity"] is None:
        capacity = "dropless (capacity_factor: null): every expert takes all it is given"
    else:
        capacity = f"C = ⌈k·T/E × factor⌉ = ⌈{k}·{t}/{e} × {f:g}⌉ = {routed['capacity']} assignments per expert"
    dropped = sum(routed["dropped"])
    lines = [capacity,
             f"dropped: {dropped} of {k * t} assignments ({routed['drop_share']:.1%}); max/mean load "
             f"{routed['max_mean']:.2f} (1 is even, {e / k:g} is everything on the busiest experts)",
             f"Switch auxiliary loss α·E·Σ fᵢ·Pᵢ = {routed['aux_loss']:.4f} at α = {routed['alpha']:g} "
             f"(α = {routed['alpha']:g} when router and load are both even; training adds it to the loss)"]
    if routed["bias_steps"]:
        bias = ", ".join(f"{b:+.2f}" for b in routed["bias"])
        lines.append(f"loss-free bias after {routed['bias_steps']} moves of ±{routed['bias_update']:g} against the "
                     f"load (for the choice only; the gates keep the router's probabilities): {bias}")
    return "\n".join(wrap(line) for line in lines)


class RoutingExplorer:
    """Sliders over one forward's routing, computed in this process by labkit's router functions: experts, top-k,
    capacity factor (or dropless), how far expert 0's logit is raised (skew), and how many times the loss-free
    bias moves against the load before the choice."""

    def __init__(self, tokens: int = 512):
        self.tokens = tokens
        style, layout = {"description_width": "170px"}, W.Layout(width="460px")
        self.experts = W.Dropdown(options=[4, 8, 16], value=EXPERTS, description="experts E", style=style,
                                  layout=layout)
        self.top_k = W.IntSlider(TOP_K, min=1, max=4, description="top-k", style=style, layout=layout)
        self.factor = W.FloatSlider(1.25, min=0.25, max=3.0, step=0.25, description="capacity factor",
                                    style=style, layout=layout)
        self.dropless = W.Checkbox(False, description="dropless (no capacity)", indent=False,
                                   layout=W.Layout(width="auto"))
        self.skew = W.FloatSlider(0.0, min=0.0, max=4.0, step=0.5, description="expert 0's logit +",
                                  style=style, layout=layout)
        self.bias_steps = W.IntSlider(0, min=0, max=300, step=10, description="loss-free bias moves",
                                      style=style, layout=layout)
        self.text = W.HTML()
        self.picture = W.Image(format="png", layout=W.Layout(max_width="100%"))
        for control in (self.experts, self.top_k, self.factor, self.dropless, self.skew, self.bias_steps):
            control.observe(lambda _: self.draw(), names="value")
        self.draw()

    def routed(self) -> dict:
        return route(self.experts.value, min(self.top_k.value, self.experts.value),
                     None if self.dropless.value else self.factor.value, self.skew.value, self.bias_steps.value,
                     tokens=self.tokens)

    def draw(self) -> None:
        self.factor.disabled = self.dropless.value
        routed = self.routed()
        self.text.value = f"<pre style='font-size:14px;margin:4px 0'>{explorer_text(routed)}</pre>"
        self.picture.value = render_png(explorer_figure(routed))

    def widget(self) -> W.Widget:
        controls = W.GridBox([self.experts, self.top_k, self.factor, self.dropless, self.skew, self.bias_steps],
                             layout=W.Layout(grid_template_columns="repeat(auto-fill, 470px)"))
        return W.VBox([W.HTML("<h3>Routing explorer</h3>"), controls, self.text, self.picture])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


# ---------------------------------------------------------------- tokens dropped against the capacity factor


def drop_figure(curves: dict[str, list[dict]], tokens: int, experts: int = EXPERTS, top_k: int = TOP_K) -> Figure:
    """The share of assignments dropped at each capacity factor, counted on each fixed routing (``curves``: label →
    :func:`labkit.moe_lab.drop_curve`'s rows), beside the formula for a router that gives every expert exactly its
    share."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.4), dpi=100, layout="constrained")
    ax = fig.subplots()
    factors = [row["factor"] for row in next(iter(curves.values()))]
    fine = [0.25 + i * 0.01 for i in range(int((max(factors) - 0.25) / 0.01) + 1)]
    ax.plot(fine, [100 * balanced_drop(tokens, experts, top_k, f) for f in fine], color="black", ls="--", lw=1.5,
            label="formula: every expert gets exactly k·T/E")
    for i, (label, rows) in enumerate(curves.items()):
        ax.plot([r["factor"] for r in rows], [100 * r["measured"] for r in rows], marker="o", ms=8, lw=2,
                color=f"C{i}", label=label)
    ax.axvline(1.25, color="grey", ls=":", lw=1.5, label="model.moe.capacity_factor's default")
    label_axes(ax, f"dropped vs capacity factor: {tokens} tokens, top-{top_k} of {experts} experts", "capacity factor",
               "% of assignments dropped", legend=False)
    ax.legend(fontsize=12)
    ax.tick_params(labelsize=12)
    return fig


def drop_lines(curves: dict[str, list[dict]]) -> list[str]:
    """Each routing's drops at each capacity factor, counted, beside the balanced formula."""
    factors = [row["factor"] for row in next(iter(curves.values()))]
    lines = ["factor            " + "".join(f"{f:>7g}" for f in factors)]
    for label, rows in curves.items():
        lines.append(f"{label[:17]:17s} " + "".join(f"{100 * r['measured']:6.1f}%" for r in rows))
    first = next(iter(curves.values()))
    lines.append(f"{'formula (even)':17s} " + "".join(f"{100 * r['balanced_formula']:6.1f}%" for r in first))
    return lines


# ---------------------------------------------------------------- the live run and the balancing runs


def live_lines(summary: Optional[dict], events: list[dict], last: int = 10) -> list[str]:
    """What the live run held and did: its parameters (all, and those one token goes through), and over its last
    ``last`` steps the max/mean load and the share dropped (means over steps and MoE layers)."""
    lines = []
    params = (summary or {}).get("params") or {}
    if params.get("total"):
        lines.append(f"parameters: {params['total']:,} held, {params['active']:,} used by each token "
                     f"({params['active'] / params['total']:.0%}; labkit.model.flops.count_params)")
    steps = routed_steps(events)
    if steps:
        max_mean, drops = mean_over_steps(steps, "moe_max_mean", last), mean_over_steps(steps, "moe_drop_rate", last)
        lines.append(f"last {min(last, len(steps))} steps: max/mean load {max_mean:.2f}, dropped "
                     f"{drops:.1%} of the assignments (means over the steps and the MoE layers)")
    if summary and summary.get("val_loss") is not None:
        lines.append(f"validation loss at the end {summary['val_loss']:.3f} nats/token")
    return lines


def balance_lines(rows: list[dict]) -> list[str]:
    """:func:`labkit.moe_lab.balance_rows` as a table."""
    def fmt(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [f"{'balance':10s} {'max/mean load':>14s} {'dropped':>9s} {'aux loss':>9s} {'val loss':>9s}"]
    for r in rows:
        lines.append(f"{r['balance']:10s} {fmt(r['max_mean'], '.2f'):>14s} {fmt(r['drop_rate'], '.1%'):>9s} "
                     f"{fmt(r['aux_loss'], '.4f'):>9s} {fmt(r['val_loss'], '.3f'):>9s}")
    return lines


def benchmark_balance_lines(record: Optional[dict]) -> list[str]:
    """``benchmarks/moe.py --balance``'s table in sentences, with where it comes from; says so where it is absent."""
    if record is None:
        return [wrap("benchmarks/results/moe.jsonl has no full --balance table yet: not measured on this checkout "
                     "(run `.venv/bin/python benchmarks/moe.py --balance`)")]
    from labkit.results import provenance

    lines = [wrap(f"benchmarks/moe.py --balance: steps from an overloaded router to max/mean ≤ "
                  f"{record['settings'].get('balanced', 1.1)} (median, IQR, over seeds)")]
    for row in record["rows"]:
        bound = "at least " if row["at_least"] else ""
        lines.append(wrap(f"  {row['method']}: {bound}{row['median']:.0f} steps (IQR {row['q1']:.0f}–{row['q3']:.0f}, "
                          f"{row['reached']} of {row['n_seeds']} seeds within {row['bound']}); language-model loss "
                          f"{row['lm_loss_last10']:.3f} over the last 10 steps", indent="    "))
    lines.append(wrap(provenance(record, "moe.jsonl"), indent="  "))
    return lines


# ---------------------------------------------------------------- expert parallelism: the all-to-all


TIMELINE_LANES = (("fwd_bwd", "forward + backward", "#4C72B0"), ("model_comm", "all-to-all (ep)", "#C44E52"),
                  ("comm", "gradient sync (dp)", "#DD8452"), ("optimizer", "optimizer", "#55A868"))


BOX_W, BOX_H = 2.6, 1.5  # a rank's box in the diagram, data units (its rounded edge adds 0.1 all round)


def between_boxes(a: tuple[float, float], b: tuple[float, float], gap: float = 0.2):
    """The two ends of an arrow from the box centred on ``a`` to the box centred on ``b``: on the line between the
    centres, ``gap`` outside each box's edge."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    length = math.hypot(dx, dy)
    ux, uy = dx / length, dy / length
    edge = min(BOX_W / 2 / abs(ux) if ux else math.inf, BOX_H / 2 / abs(uy) if uy else math.inf) + 0.1 + gap
    return (a[0] + edge * ux, a[1] + edge * uy), (b[0] - edge * ux, b[1] - edge * uy)


def _rank_box(ax, x: float, y: float, rank: int, first: int, last: int) -> None:
    ax.add_patch(FancyBboxPatch((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0.1",
                                facecolor="#EEF2F8", edgecolor="#4C72B0", lw=2))
    experts = f"expert {first}" if first == last else f"experts {first}–{last}"
    ax.text(x, y + 0.25, f"rank {rank}", ha="center", va="center", fontsize=13, weight="bold")
    ax.text(x, y - 0.3, experts, ha="center", va="center", fontsize=12)


def rank_places(ep: int) -> list[tuple[float, float]]:
    """Where the diagram draws each ep rank: side by side for two, at the corners of a square for four (clockwise
    from the top left), round an ellipse for more."""
    if ep <= 2:
        return [(0.0, 0.0)] if ep == 1 else [(-2.0, 0.0), (2.0, 0.0)]
    if ep == 4:
        return [(-2.0, 1.6), (2.0, 1.6), (2.0, -1.6), (-2.0, -1.6)]
    return [(2.4 * math.cos(math.pi * (1 - 2 * r / ep)), 1.6 * math.sin(math.pi * (1 - 2 * r / ep)))
            for r in range(ep)]


def all_to_all_figure(record: dict) -> Figure:
    """Left: the ep ranks, each holding E/ep experts, every pair exchanging tokens both ways (dispatch, then combine:
    an all-to-all), with the bytes rank 0 sent per step counted beside the balanced formula. Right: rank 0's typical
    step, the all-to-alls (blocking, inside forward and backward) on their own lane."""
    ep, experts = record["ep"], record["experts"]
    fig = Figure(figsize=(FIGURE_WIDTH, 4.8), dpi=100, layout="constrained")
    ax_map, ax_time = fig.subplots(1, 2, width_ratios=(1.15, 1))
    ax_map.set_xlim(-3.6, 3.6)
    ax_map.set_ylim(-5.4, 2.7)
    ax_map.set_axis_off()
    places = rank_places(ep)
    for a in range(ep):
        for b in range(a + 1, ep):
            ax_map.add_patch(FancyArrowPatch(*between_boxes(places[a], places[b]), arrowstyle="<|-|>",
                                             mutation_scale=18, lw=2, color="#C44E52", shrinkA=0, shrinkB=0))
    per_rank = experts // ep
    for r, (x, y) in enumerate(places):
        _rank_box(ax_map, x, y, r, r * per_rank, (r + 1) * per_rank - 1)
    ax_map.set_title(f"all-to-all over ep = {ep}:\ntokens to their experts and back", fontsize=13)
    ax_map.text(0, -3.4, f"rank 0 sent {_bytes(record['bytes_per_step'])} a step (counted)\n"
                         f"balanced formula: {_bytes(record['formula_bytes'])}",
                ha="center", va="center", fontsize=12)
    micro = record["micro_batches"]
    ax_map.text(0, -4.75, f"{record['moe_layers']} MoE layers × {micro} micro-batch{'es' if micro != 1 else ''} × 4 "
                         f"all-to-alls", ha="center", va="center", fontsize=12, color="dimgray")
    timeline = record["timeline"]
    for lane, (key, name, color) in enumerate(TIMELINE_LANES):
        spans = [(1e3 * a, 1e3 * (b - a)) for a, b in timeline.get(key) or []]
        if spans:
            ax_time.broken_barh(spans, (lane - 0.35, 0.7), color=color)
    ax_time.set_yticks(range(len(TIMELINE_LANES)), [name for _, name, _ in TIMELINE_LANES], fontsize=12)
    ax_time.set_ylim(len(TIMELINE_LANES) - 0.5, -0.5)
    share = f"{record['all_to_all_frac']:.0%}"
    label_axes(ax_time, f"rank 0, step {record['typical_step']}:\nthe all-to-alls {share} of it",
               "ms since the step started", "", legend=False)
    ax_time.tick_params(labelsize=12)
    return fig


def ep_lines(record: dict) -> list[str]:
    """The expert-parallel run's all-to-all, in sentences: bytes counted beside the balanced formula, the time."""
    ratio = record["counted_vs_formula"]
    return [wrap(f"{record['config']}; experts spread over ep = {record['ep']} ranks"),
            wrap(f"bytes rank 0 sent on the ep axis per step (median of {record['steps']} steps, counted at the "
                 f"collectives): {record['bytes_per_step']:,.0f} B; a perfectly balanced router would send "
                 f"{record['formula_bytes']:,.0f} B (formula: 4·k·T·d·(ep − 1)/ep per layer and micro-batch, fp32, "
                 f"plus the counts) — counted/formula {'n/a' if ratio is None else f'{ratio:.3f}'}"),
            wrap(f"time in the all-to-alls: {1e3 * record['all_to_all_s']:.1f} ms of a {1e3 * record['step_s']:.1f} "
                 f"ms step ({record['all_to_all_frac']:.0%}; blocking: all of it exposed); "
                 f"{record['drop_rate']:.1%} of the assignments dropped over capacity (not sent)")]


def benchmark_ep_lines(record: Optional[dict]) -> list[str]:
    """``benchmarks/moe.py --ep``'s table in sentences, with where it comes from; says so where it is absent."""
    if record is None:
        return [wrap("benchmarks/results/moe.jsonl has no full --ep table yet: not measured on this checkout "
                     "(run `.venv/bin/python benchmarks/moe.py --ep`)")]
    from labkit.results import provenance

    lines = [wrap("benchmarks/moe.py --ep: one MoE GPT on 4 processes at ep = 1, 2 and 4, in rounds of the three "
                  "(step time against ep = 1; the all-to-all's share of the step; rank 0's bytes on the ep axis)")]
    for row in record["rows"]:
        lines.append(wrap(f"  {row['summary']}; all-to-all {row['measured_all_to_all_frac']:.0%} of the step; "
                          f"{row['bytes_per_step_counted']:,.0f} B a step, {row['counted_vs_formula']:.3f}× the "
                          f"balanced formula; labkit.sim's calibrated step model (modelled, told the measured "
                          f"max/mean {row['measured_max_mean']:.2f}): step {row['modelled_vs_measured_step']:.2f}×, "
                          f"all-to-all {row['modelled_vs_measured_all_to_all']:.2f}× the measured", indent="    "))
    lines.append(wrap(provenance(record, "moe.jsonl"), indent="  "))
    return lines


# ---------------------------------------------------------------- the scaling trade, from benchmarks/results/moe.jsonl


def trade_figure(trade: dict) -> Figure:
    """``benchmarks/moe.py --dense``: parameters held and FLOPs per token (labkit's counts) of the dense and the MoE
    GPT, and the validation loss each reached after the same steps, with the corpus's floor."""
    flops, dense, moe = trade["flops"], trade["dense"], trade["moe"]
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax_size, ax_loss = fig.subplots(1, 2)
    names, colors = ["dense", "MoE"], ["#8C8C8C", "#4C72B0"]
    held = [flops["dense_params"]["total"], flops["moe_params"]["total"]]
    used = [flops["dense_flops_per_token"], flops["moe_flops_per_token"]]
    ratios = [h / held[0] for h in held] + [u / used[0] for u in used]
    ax_size.bar([0, 1, 3, 4], ratios, color=colors * 2)
    ax_size.set_xticks([0.5, 3.5], ["parameters held", "FLOPs per token"], fontsize=12)
    for x, value in zip([0, 1, 3, 4], ratios):
        ax_size.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=12)
    label_axes(ax_size, "MoE over dense (labkit's counts)", "", "× the dense GPT's", legend=False)
    ax_size.legend(handles=[Patch(color=c, label=n) for c, n in zip(colors, names)],
                   fontsize=12, loc="upper left")
    ax_size.set_ylim(0, 1.3 * max(held[1] / held[0], used[1] / used[0], 1.0))
    losses = [dense["val_loss"], moe["val_loss"]]
    ax_loss.bar([0, 1], losses, color=colors)
    for x, value in enumerate(losses):
        ax_loss.text(x, value, f"{value:.3f}", ha="center", va="bottom", fontsize=12)
    if dense.get("val_floor"):
        ax_loss.axhline(dense["val_floor"], color="black", ls="--", label="the corpus's entropy floor")
        ax_loss.legend(fontsize=12, loc="lower right")
    low = min(losses + [dense.get("val_floor") or min(losses)])
    ax_loss.set_ylim(max(0.0, low - 0.3), max(losses) + 0.15)
    ax_loss.set_xticks([0, 1], names, fontsize=12)
    steps = trade["record"]["settings"].get("steps")
    label_axes(ax_loss, f"validation loss after {steps} steps", "", "nats/token", legend=False)
    ax_loss.tick_params(labelsize=12)
    ax_size.tick_params(labelsize=12)
    return fig


def trade_lines(trade: Optional[dict]) -> list[str]:
    """The scaling trade in sentences, with where it comes from; says so where it has not been measured."""
    if trade is None:
        return [wrap("benchmarks/results/moe.jsonl has no full --dense table yet: the scaling trade is not measured on "
                     "this checkout (run `.venv/bin/python benchmarks/moe.py --dense`, then this cell again)")]
    from labkit.results import provenance

    flops, speed, dense, moe = trade["flops"], trade["speed"], trade["dense"], trade["moe"]
    lines = [wrap(f"parameters held: dense {flops['dense_params']['total']:,}, MoE {flops['moe_params']['total']:,}; "
                  f"FLOPs per token MoE/dense {flops['ratio']:.4f} ({'within' if flops['held'] else 'NOT within'} "
                  f"{flops['tolerance']:.0%}: the router's E·d per layer)")]
    for name, row in (("dense", dense), ("MoE", moe)):
        lines.append(f"{name:5s}: validation loss {row['val_loss']:.4f}, training loss (last 10 steps) "
                     f"{row['train_loss_last10']:.4f}")
    if speed:
        lines.append(wrap(f"speed: {speed['summary']}"))
    lines.append(wrap(provenance(trade["record"], "moe.jsonl"), indent="  "))
    return lines


__all__ = ["RoutingExplorer", "explorer_figure", "explorer_text", "drop_figure", "drop_lines", "live_lines",
           "balance_figure", "balance_lines", "benchmark_balance_lines", "all_to_all_figure", "ep_lines",
           "benchmark_ep_lines",
           "trade_figure", "trade_lines", "ROUTING_FIGURE"]
