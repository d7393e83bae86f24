"""The model-parallel lab: split one model over tensor-parallel ranks, pipeline stages and data-parallel replicas,
and see what each split costs.

``run_layouts`` launches one real run per layout (one after another, so they do not compete for the cores) and
keeps each run's events and config; the pictures read them through :mod:`labkit.parallel.reports.layout`: the
schedule a pipeline really ran beside the ideal grid, the bubble against the number of micro-batches with the
formula, tensor parallelism's bytes per layer beside the analytic count, memory per rank beside the prediction,
and the step time split into compute, communication and bubble. :class:`ModelParallelLab` puts the layout on
widgets, refuses a layout that cannot run before anything starts, and draws the same pictures for a live run.

The figures themselves are in :mod:`labkit.widgets.model_parallel_figures` (projector-sized), the printed tables in
:mod:`labkit.widgets.model_parallel_text` (narrow enough not to wrap).
"""
from __future__ import annotations

from html import escape
from typing import Callable, Optional

import ipywidgets as W
from matplotlib.figure import Figure

from labkit.config import (Config, ConfigError, cpu_count, load_config, max_procs, resolve_device,
                           resolve_strategy)
from labkit.experiments import LOG_TAIL, sweep
from labkit.parallel.reports.activation_memory import activation_memory
from labkit.parallel.reports.layout import (bubble_over_m, pipeline_summary, rank_memory, start_event,
                                           step_split, tp_bytes_per_layer)
from labkit.parallel.mesh import DEGREES
from labkit.parallel.spec import IMPLS, strategy_choices
from labkit.parallel.pp.pipeline import SCHEDULES, ideal_bubble
from labkit.plots import render_png
from labkit.validation import machine_warnings, oversubscribed_limit, validate
from labkit.widgets.dashboard import RunDashboard
from labkit.widgets.model_parallel_text import (activation_text, bubble_text, in_flight_text, memory_text,  # noqa: F401
                                               split_text, tp_bytes_text)  # the notebook prints them from here
from labkit.widgets.model_parallel_figures import (PART_NAMES, activation_figure, bubble_figure,  # noqa: F401
                                                  ideal_schedules_figure, memory_figure, schedule_figure,
                                                  step_split_figure,
                                                  tp_bytes_figure)  # the notebook draws them from here

Progress = Optional[Callable[[str], None]]

PROCESS_COUNTS = (1, 2, 4, 8)


# ---------------------------------------------------------------- runs

def layout_label(overrides: dict, nproc: int) -> str:
    """A short name for a layout: ``tp=2 SP``, ``pp=2 1f1b``, ``dp=2 × tp=2``."""
    tp, pp = overrides.get("parallel.tp.degree", 1), overrides.get("parallel.pp.degree", 1)
    degrees = {"dp": nproc // max(1, tp * pp), "pp": pp, "tp": tp}
    parts = [f"{axis}={degrees[axis]}" for axis in DEGREES if degrees.get(axis, 1) > 1] or ["1 process"]  # mesh order
    label = " × ".join(parts)
    if overrides.get("parallel.tp.sequence_parallel"):
        label += " SP"
    if pp > 1 and "parallel.pp.schedule" in overrides:
        label += f" {overrides['parallel.pp.schedule']}"
    return label


def layout_record(run, label: str, overrides: dict) -> dict:
    """What a lab keeps of a finished run: its label, its config (as the run saved it) and its events."""
    return {"label": label, "cfg": load_config(run.run_dir / "config.json"), "events": run.events(),
            "nproc": run.nproc, "run_dir": str(run.run_dir)}


def run_layouts(config: Config, nproc: int, points: list[tuple[str, dict]], progress: Progress = None) -> list[dict]:
    """One real run per ``(label, overrides)`` on ``nproc`` processes, in turn; each run's :func:`layout_record`."""
    return sweep(config, nproc, points, layout_record, progress)


def micro_batch_overrides(config: Config, m: int, dp: int = 1) -> dict:
    """The global batch that gives m micro-batches per step per pipeline: m × dp × data.micro_batch_size."""
    return {"data.batch_size": m * dp * config.data.micro_batch_size}


def layout_point(config: Config, nproc: int, tp: int = 1, pp: int = 1, m: int = 2, schedule: Optional[str] = None,
                 sequence_parallel: bool = False, extra: Optional[dict] = None) -> tuple[str, dict]:
    """``(label, overrides)`` for a (dp, pp, tp) layout on ``nproc`` processes (dp is what tp and pp leave) with m
    micro-batches per step: a point for :func:`run_layouts`."""
    dp = nproc // (tp * pp)
    overrides = {"parallel.tp.degree": tp, "parallel.pp.degree": pp, "parallel.dp.degree": dp,
                 **micro_batch_overrides(config, m, dp)}
    if sequence_parallel:
        overrides["parallel.tp.sequence_parallel"] = True
    if schedule:
        overrides["parallel.pp.schedule"] = schedule
    overrides.update(extra or {})
    return layout_label(overrides, nproc) + (f" m={m}" if pp > 1 else ""), overrides


def process_options(config: Config) -> list[tuple[str, int]]:
    """The process counts this machine runs (``labkit.config.max_procs``), and 8 where the model is small
    enough to oversubscribe the CPU cores (``labkit.validation.oversubscribed_limit``), labelled with its cost."""
    device = resolve_device(config)
    limit, options = max(1, max_procs(device)), []
    for n in PROCESS_COUNTS:
        if n <= limit:
            options.append((str(n), n))
        elif device == "cpu" and n <= oversubscribed_limit(config):
            options.append((f"{n} (oversubscribed: {n / cpu_count():g} per core, slow)", n))
    return options


def choose_nproc(config: Config, want: int) -> tuple[int, str]:
    """``want`` processes if this machine allows them, else the most it allows below ``want`` (or the fewest);
    and a sentence saying what was chosen, and what it costs (oversubscribed CPU cores)."""
    allowed = [n for _, n in process_options(config)]
    below = [n for n in allowed if n <= want]
    n = want if want in allowed else (max(below) if below else min(allowed))
    device = resolve_device(config)
    limit = max_procs(device)
    where = f"{limit} GPU(s)" if device == "cuda" else f"{cpu_count()} CPU core(s): up to {limit} processes"
    note = f"{n} processes ({where})"
    if n != want:
        note += f"; {want} asked for, which this machine cannot host"
    warnings = machine_warnings(config, n)
    return n, note + (f". {warnings[0]}" if warnings else "")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- records → report rows

def tp_bytes_rows(records: list[dict]) -> list[tuple[str, dict]]:
    """(label, :func:`labkit.parallel.reports.layout.tp_bytes_per_layer`) of each tp-only run."""
    return [(r["label"], tp_bytes_per_layer(steady_last(r["events"]), start_event(r["events"]), r["cfg"]))
            for r in records]


def pipeline_rows(records: list[dict]) -> list[tuple[str, dict]]:
    """(label, :func:`labkit.parallel.reports.layout.pipeline_summary`) of each pipeline run."""
    return [(r["label"], pipeline_summary(r["events"], r["cfg"])) for r in records]


def bubble_rows(records: list[dict]) -> list[dict]:
    """:func:`labkit.parallel.reports.layout.bubble_over_m` of pipeline runs differing in m."""
    return bubble_over_m([(r["events"], r["cfg"]) for r in records])


def memory_rows(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """(label, :func:`labkit.parallel.reports.layout.rank_memory`) of each run."""
    return [(r["label"], rank_memory(r["events"], r["cfg"])) for r in records]


def split_rows(records: list[dict]) -> list[tuple[str, dict]]:
    """(label, :func:`labkit.parallel.reports.layout.step_split`) of each run."""
    return [(r["label"], step_split(r["events"])) for r in records]


def steady_last(events: list[dict]) -> dict:
    """The last step event (rank 0's counts in one steady step)."""
    return [e for e in events if e.get("type") == "step"][-1]


# ---------------------------------------------------------------- compositions and activations

COMPOSITIONS = ((1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 2, 2))  # (dp, pp, tp): a split model beside replicas


def composition_points(config: Config, nproc: int, m: int = 4, every: bool = True) -> list[tuple[str, dict]]:
    """Points for :func:`run_layouts` composing two or three axes on ``nproc`` processes (tp × pp first; with
    ``every``, also dp × tp and dp × pp). None fits fewer than 4 processes."""
    fits = [c for c in COMPOSITIONS if c[0] * c[1] * c[2] == nproc]
    return [layout_point(config, nproc, tp=tp, pp=pp, m=m, schedule="1f1b" if pp > 1 else None)
            for dp, pp, tp in (fits if every else fits[:1])]


def activation_rows(records: list[dict]) -> list[tuple[str, dict]]:
    """(label, :func:`~labkit.parallel.reports.activation_memory.activation_memory`) of each run: every rank's
    activations,
    measured (what autograd saved in one micro-batch's forward, times the micro-batches held at once) beside the
    count for its stage."""
    return [(r["label"], activation_memory(r["events"], r["cfg"])) for r in records]


# ---------------------------------------------------------------- the lab

class ModelParallelLab:
    """Widgets for a layout — processes, tp, pp (dp is what they leave), implementations, schedule, sequence
    parallelism, micro-batches — and a Run button: a layout that cannot run is explained before anything
    starts; one that can runs live (progress on a dashboard), then its pictures are drawn."""

    def __init__(self, config: Config, nproc: int = 2):
        self.base = config
        self.record: Optional[dict] = None
        self.run_handle = None
        style, layout = {"description_width": "150px"}, W.Layout(width="440px")
        options = process_options(config)
        allowed = [n for _, n in options]
        self.nproc = W.Dropdown(options=options, value=nproc if nproc in allowed else allowed[-1],
                                description="processes", style=style, layout=layout)
        self.tp = W.Dropdown(options=[1], value=1, description="tp (tensor)", style=style, layout=layout)
        self.pp = W.Dropdown(options=[1], value=1, description="pp (pipeline)", style=style, layout=layout)
        self.dp = W.IntText(value=1, description="dp (the rest)", disabled=True, style=style, layout=layout)
        self.schedule = W.Dropdown(options=list(SCHEDULES), value=config.parallel.pp.schedule,
                                   description="pp schedule", style=style, layout=layout)
        self.pp_impl, self.tp_impl = (  # each axis's implementations: labkit.parallel.spec.IMPLS
            W.Dropdown(options=list(IMPLS[axis]), value=getattr(config.parallel, axis).impl,
                       description=f"{axis} impl", style=style, layout=layout) for axis in ("pp", "tp"))
        self.sequence_parallel = W.Checkbox(value=False, description="sequence parallel", style=style)
        self.micro_batches = W.Dropdown(options=[1, 2, 4, 8], value=4, description="micro-batches / step",
                                        style=style, layout=layout)
        self.strategy = W.Dropdown(options=strategy_choices(), value=config.parallel.dp.strategy,
                                   description="dp strategy", style=style, layout=layout)  # auto: one that combines
        self.run_button = W.Button(description="Run", button_style="success", icon="play",
                                   layout=W.Layout(width="auto"))
        self.status = W.HTML()
        self.dashboard = RunDashboard("model-parallel lab")
        self.figures = W.VBox()
        self.run_button.on_click(lambda _: self.run())
        self._updating = False
        self.nproc.observe(self._on_degrees, names="value")
        self.tp.observe(self._on_degrees, names="value")
        self.pp.observe(self._on_degrees, names="value")
        for widget in (self.schedule, self.pp_impl, self.tp_impl, self.sequence_parallel, self.micro_batches,
                       self.strategy):
            widget.observe(self._on_change, names="value")
        self._on_degrees()

    @property
    def controls(self) -> list[W.Widget]:
        return [self.nproc, self.tp, self.pp, self.dp, self.schedule, self.pp_impl, self.tp_impl,
                self.sequence_parallel, self.micro_batches, self.strategy]

    def _on_degrees(self, change=None) -> None:
        """Keep dp × tp × pp = processes: tp divides the processes, pp what tp leaves, dp is the rest."""
        if self._updating:
            return
        self._updating = True
        try:
            n = self.nproc.value
            tp = self.tp.value if n % self.tp.value == 0 else 1
            self.tp.options = divisors(n)
            self.tp.value = tp
            rest = n // tp
            pp = self.pp.value if rest % self.pp.value == 0 else 1
            self.pp.options = divisors(rest)
            self.pp.value = pp
            self.dp.value = rest // pp
        finally:
            self._updating = False
        self._on_change()

    def overrides(self) -> dict:
        dp = self.dp.value
        return {"parallel.tp.degree": self.tp.value, "parallel.pp.degree": self.pp.value, "parallel.dp.degree": dp,
                "parallel.tp.impl": self.tp_impl.value, "parallel.tp.sequence_parallel": self.sequence_parallel.value,
                "parallel.pp.schedule": self.schedule.value, "parallel.pp.impl": self.pp_impl.value,
                "parallel.dp.strategy": self.strategy.value,
                **micro_batch_overrides(self.base, self.micro_batches.value, dp)}

    def config(self) -> Config:
        return self.base.replace(**self.overrides())

    def label(self) -> str:
        pp = self.pp.value > 1
        return layout_label(self.overrides(), self.nproc.value) + (f" m={self.micro_batches.value}" if pp else "")

    def problems(self) -> list[str]:
        try:
            validate(self.config(), nproc=self.nproc.value)
        except ConfigError as error:
            return error.problems
        return []

    def _say(self, html: str, color: str = "inherit") -> None:
        self.status.value = f"<div style='font-size:1.1em;color:{color}'>{html}</div>"

    def _on_change(self, change=None) -> None:
        problems = self.problems()
        self.run_button.disabled = bool(problems)
        if problems:
            items = "".join(f"<li>{escape(p)}</li>" for p in problems)
            self._say(f"<b>Cannot run this layout:</b><ul style='margin:0;padding-left:1.2em'>{items}</ul>", "#b00020")
            return
        n, m = self.nproc.value, self.micro_batches.value
        text = (f"✓ {self.label()}: dp={self.dp.value} × pp={self.pp.value} × tp={self.tp.value} = {n} processes, "
                f"{m} micro-batch(es) of {self.base.data.micro_batch_size} sequences per step")
        if self.pp.value > 1:
            text += f"; ideal bubble (p − 1)/(m + p − 1) = {100 * ideal_bubble(self.pp.value, m):.0f}%"
        _, chosen = resolve_strategy(self.config())
        if chosen:
            text += f"<br>dp strategy {escape(chosen)}"
        warnings = machine_warnings(self.config(), n)
        if warnings:
            text += f"<br><span style='color:#8a5a00'>⚠ {escape(warnings[0])}</span>"
        self._say(text, "#1b5e20")

    def run(self) -> Optional[dict]:
        """Validate, launch and follow one run; then draw its pictures. A layout that cannot run starts nothing
        (None, and the reasons on the panel)."""
        from labkit.launcher import launch

        problems = self.problems()
        if problems:
            self._on_change()
            return None
        cfg, n, label = self.config(), self.nproc.value, self.label()
        self.run_button.disabled = True
        try:
            self._say(f"running {label} on {n} processes…")
            self.run_handle = launch(cfg, nproc=n)
            self.dashboard.follow_in_background(self.run_handle)
            status = self.run_handle.wait()  # an interrupt stops the run (Run.wait)
            self.dashboard.join()
            if status != "finished":
                tail = escape(self.run_handle.log()[-LOG_TAIL:])
                self._say(f"<b>Run {status}</b>: see {self.run_handle.run_dir}/launcher.log<pre>{tail}</pre>",
                          "#b00020")
                return None
            self.record = layout_record(self.run_handle, label, self.overrides())
            self.draw(self.record)
        finally:
            self.run_button.disabled = bool(self.problems())
        return self.record

    def figures_for(self, record: dict) -> list[Figure]:
        """The pictures a run of this layout has: the step split and memory per rank always, the schedule for a
        pipeline, tensor parallelism's bytes when tp > 1."""
        events, cfg, label = record["events"], record["cfg"], record["label"]
        mesh = start_event(events)["mesh"]
        figures = [step_split_figure([(label, step_split(events))]), memory_figure([(label, rank_memory(events, cfg))]),
                   activation_figure(activation_rows([record]))]
        if mesh["pp"] > 1:
            s = pipeline_summary(events, cfg)
            figures.append(schedule_figure(s["grid"], s["ideal_grid"], label))
        if mesh["tp"] > 1:
            figures.append(tp_bytes_figure(tp_bytes_rows([record])))
        return figures

    def draw(self, record: dict) -> None:
        events, cfg, label = record["events"], record["cfg"], record["label"]
        lines = [split_text([(label, step_split(events))])]
        mesh = start_event(events)["mesh"]
        if mesh["pp"] > 1:
            s = pipeline_summary(events, cfg)
            lines.append(bubble_text(bubble_over_m([(events, cfg)])))
            lines.append(in_flight_text([(label, s)]))
        self.figures.children = [W.Image(value=render_png(fig), format="png") for fig in self.figures_for(record)]
        text = "\n\n".join(lines + [activation_text(activation_rows([record]))])
        self._say(f"<pre style='font-size:0.95em'>{escape(text)}</pre>")

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Model-parallel layout</h3>"), *self.controls, self.run_button, self.status,
                       self.dashboard.widget, self.figures])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())

