"""The communication lab: put a run on a slow (emulated) network, then rescue it.

The source text's claims, made measurable on one machine: above ~35% of step time in
communication, scaling efficiency collapses; under ~25% it holds; compression and mixed
precision cut communication. Each function launches real runs and returns their summaries; the
figures draw them with the 25% and 35% lines.

The experiments fit the machine they run on (``labkit.widgets.network_lesson`` chooses them and says why): the
bandwidths are chosen from this machine's measured compute time, so that the slow links really are
communication-bound here, and bf16 compute is used only where bf16 measured fast.
"""
from __future__ import annotations

from typing import Callable, Optional

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from labkit import experiments
from labkit.config import Config, compressor_names, sync_names
from labkit.experiments import run_to_end
from labkit.cpu import current_load
from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS, comm_text, communication_row, cumulative
from labkit.plots import FIGURE_WIDTH, label_axes, render_png
from labkit.widgets.picture import Picture

Progress = Optional[Callable[[str], None]]


def lab_row(run, label: str, settings: dict) -> dict:
    """A run's :func:`communication_row`, with what the lab judges it by: tokens/s and collectives per step, and the
    machine's 1-minute load when it ended (runs one after another can meet different loads)."""
    calls = [c for c in run.metrics.get("comm_calls", []) if c is not None]
    return {**communication_row(run, label, settings), "tokens_per_s_steps": run.metrics["tokens_per_s"],
            "comm_calls": sum(calls) / len(calls) if calls else 0.0, "load_1min": current_load()["load_1min"]}


def run_setting(config: Config, nproc: int, settings: dict, label: str) -> dict:
    """One real run with ``settings`` (dotted config keys); its :func:`lab_row`."""
    return lab_row(run_to_end(config.replace(**settings), nproc, label), label, settings)


def sweep(config: Config, nproc: int, settings: list[tuple[str, dict]], progress: Progress = None) -> list[dict]:
    """One real run per ``(label, settings)``, in turn (:func:`labkit.experiments.sweep`)."""
    return experiments.sweep(config, nproc, settings, lab_row, progress)


def bandwidth_settings(bandwidths_gbps: list[float], compressions: list[str], latency_us: float = 50.0):
    return [(f"{c} @ {b:g} Gb/s", {"comm.bandwidth_gbps": b, "comm.latency_us": latency_us, "comm.compression": c})
            for c in compressions for b in bandwidths_gbps]


def comm_frac_figure(rows: list[dict]) -> Figure:
    """Communication share and throughput against bandwidth, one line per compressor."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax_frac, ax_tput = fig.subplots(1, 2)
    for compression in dict.fromkeys(r["comm.compression"] for r in rows):
        mine = sorted((r for r in rows if r["comm.compression"] == compression), key=lambda r: r["comm.bandwidth_gbps"])
        bw = [r["comm.bandwidth_gbps"] for r in mine]
        line, = ax_frac.plot(bw, [100 * r["comm_frac"] for r in mine], "o-", lw=2, label=f"{compression}: in flight")
        exposed = [r.get("comm_exposed_frac") for r in mine]
        if all(e is not None for e in exposed):
            ax_frac.plot(bw, [100 * e for e in exposed], "s:", lw=2, color=line.get_color(),
                         label=f"{compression}: exposed")
        ax_tput.plot(bw, [r["tokens_per_s"] for r in mine], "o-", lw=2, label=compression)
    for level, text in ((SCALING_HOLDS, "scaling holds"), (SCALING_COLLAPSES, "scaling collapses")):
        ax_frac.axhline(100 * level, ls="--", color="gray")
        ax_frac.text(0.02, 100 * level + 1, f"{100 * level:.0f}% exposed: {text}", fontsize=11, color="gray",
                     transform=ax_frac.get_yaxis_transform())  # x: a fraction of the axes, whatever its scale
    for ax, title, ylabel in ((ax_frac, "Communication share of step time", "%"),
                              (ax_tput, "Throughput", "tokens/s")):
        ax.set_xscale("log")
        label_axes(ax, title, "emulated bandwidth (Gb/s)", ylabel)
    return fig


def loss_figure(rows: list[dict]) -> Figure:
    """Loss against steps and against bytes sent: what compression costs in accuracy, per byte saved."""
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=100, layout="constrained")
    ax_step, ax_bytes = fig.subplots(1, 2)
    for r in rows:
        ax_step.plot(r["step"], r["loss"], lw=1.5, label=r["label"])
        ax_bytes.plot([b / 1e6 for b in cumulative(r["wire_bytes"])], r["loss"], lw=1.5, label=r["label"])
    floor = next((r["entropy_floor"] for r in rows if r.get("entropy_floor")), None)
    for ax in (ax_step, ax_bytes):
        if floor:
            ax.axhline(floor, ls="--", color="gray", label="entropy floor")
        ax.set_ylabel("training loss (nats/token)", fontsize=12)
        ax.grid(alpha=0.3)
    ax_step.set_xlabel("step", fontsize=12)
    ax_bytes.set_xlabel("MB sent per rank (cumulative)", fontsize=12)
    ax_bytes.set_xscale("symlog", linthresh=0.01)
    ax_bytes.set_xlim(left=0)  # bytes sent are never negative (the symlog axis' margin drew negative megabytes)
    ax_step.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax_step.set_title("Loss vs steps", fontsize=14)
    ax_bytes.set_title("Loss vs bytes on the wire", fontsize=14)
    ax_step.legend(fontsize=10)
    return fig


def sent_share_figure(shares: dict[str, float], label: str, budget: Optional[float] = None) -> Figure:
    """Where a sparsifier's bytes went: the fraction of each parameter's entries sent per step.

    ``shares`` is a run's ``summary["sent_shares"]`` (rank 0's picks). Bars are sorted, largest on
    top, on a log scale; a parameter that never sent anything is drawn at the axis' left edge and
    labelled 0. ``budget`` (the compressor's ratio) is drawn as a dashed line: top-k's average.
    """
    names = sorted(shares, key=shares.get)
    smallest = min([v for v in shares.values() if v > 0] + [budget or 1.0]) / 10
    fig = Figure(figsize=(FIGURE_WIDTH, 1.6 + 0.36 * len(names)), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.barh(names, [100 * max(shares[n], smallest) for n in names], color="tab:blue")
    for y, name in enumerate(names):
        ax.text(100 * max(shares[name], smallest), y, f" {100 * shares[name]:.2g}%", va="center", fontsize=10)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}%"))
    if budget:
        ax.axvline(100 * budget, ls="--", color="gray", label=f"the budget: {budget:.0%} of all entries")
    label_axes(ax, f"{label}: where the bytes went", "entries sent per step (% of the parameter's)", "",
               legend=bool(budget))
    return fig


class CommunicationLab:
    """Widgets: compressor and its knob, sync period H, emulated bandwidth and latency, precision."""

    def __init__(self, config: Config, nproc: int = 2):
        style, layout = {"description_width": "150px"}, W.Layout(width="440px")
        self.base, self.nproc, self.rows = config, nproc, []
        self.compression = W.Dropdown(options=list(compressor_names()),
                                      value="none", description="compression", style=style, layout=layout)
        self.ratio = W.FloatLogSlider(value=0.01, base=10, min=-3, max=0, description="top-k / random-k ratio",
                                      style=style, layout=layout)
        self.rank = W.IntSlider(2, min=1, max=8, description="PowerSGD rank", style=style, layout=layout)
        self.sync = W.Dropdown(options=list(sync_names()), value="every_step",
                               description="synchronise", style=style, layout=layout)
        self.every = W.IntSlider(8, min=1, max=64, description="every H steps", style=style, layout=layout)
        self.bandwidth = W.SelectionSlider(options=[("0.1 Gb/s", 0.1), ("1 Gb/s", 1.0), ("10 Gb/s", 10.0),
                                                    ("100 Gb/s", 100.0), ("loopback", None)], value=1.0,
                                           description="network", style=style, layout=layout)
        self.latency = W.IntSlider(50, min=0, max=1000, step=10, description="latency (µs)", style=style,
                                   layout=layout)
        self.precision = W.Dropdown(options=["fp32", "bf16"], value="fp32", description="precision", style=style,
                                    layout=layout)
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.status = W.HTML()
        self.picture = Picture(waiting="Press Run: each run adds its loss curves here.")
        self.shares_picture = Picture(waiting="")  # where a sparsifier's bytes went: shown after a top-k run
        self.shares_picture.layout.display = "none"
        self.run_button.on_click(lambda _: self.run())

    @property
    def controls(self):
        return [self.compression, self.ratio, self.rank, self.sync, self.every, self.bandwidth, self.latency,
                self.precision]

    def settings(self) -> dict:
        return {"comm.compression": self.compression.value if self.sync.value == "every_step" else "none",
                "comm.compression_ratio": self.ratio.value, "comm.powersgd_rank": self.rank.value,
                "comm.sync": self.sync.value, "comm.sync_every": self.every.value,
                "comm.bandwidth_gbps": self.bandwidth.value, "comm.latency_us": float(self.latency.value),
                "precision.mode": self.precision.value}

    def label(self) -> str:
        s = self.settings()
        what = s["comm.sync"] if s["comm.sync"] != "every_step" else s["comm.compression"]
        if s["comm.sync"] != "every_step":
            what += f" H={s['comm.sync_every']}"
        net = "loopback" if s["comm.bandwidth_gbps"] is None else f"{s['comm.bandwidth_gbps']:g} Gb/s"
        return f"{what}, {s['precision.mode']}, {net}"

    def run(self) -> dict:
        self.run_button.disabled = True
        self.status.value = f"<div style='font-size:1.15em'>running {self.label()}…</div>"
        try:
            row = run_setting(self.base, self.nproc, self.settings(), self.label())
        except Exception as error:
            self.status.value = f"<div style='color:#b00020;font-size:1.15em'><b>Failed:</b> {error}</div>"
            raise
        finally:
            self.run_button.disabled = False
        self.rows.append(row)
        self.status.value = (f"<div style='font-size:1.15em'>{row['label']}: "
                             f"{comm_text(row['comm_frac'], row.get('comm_exposed_frac'))} of step time, "
                             f"{row['tokens_per_s']:,.0f} tokens/s, "
                             f"final loss {row['final_loss']:.3f}</div>")
        self.draw(row)
        return row

    def draw(self, row: dict) -> None:
        """Every run's loss curves; for a top-k or random-k run, also where its bytes went."""
        self.picture.value = render_png(loss_figure(self.rows))
        shares = row.get("sent_shares")
        if shares:
            self.shares_picture.value = render_png(sent_share_figure(shares, row["label"],
                                                                     budget=row.get("comm.compression_ratio")))
        self.shares_picture.layout.display = None if shares else "none"

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Communication</h3>"), *self.controls, self.run_button, self.status, self.picture,
                       self.shares_picture])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
