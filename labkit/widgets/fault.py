"""The fault-tolerance lab: break a live run on purpose and watch it come back, bit for bit.

``FaultToleranceLab`` starts a 2-process run with checkpoints and a restart budget; its
**Kill rank 1** button sends SIGKILL to a worker, as a failing node would vanish. The elastic agent
restarts the group, the run resumes from its newest valid checkpoint and the loss curve continues; a
watcher thread follows the run to its end and says where it resumed and how long recovering took.
**Compare with a clean run** trains the same config without the fault and compares the final
parameters bit for bit — but only after a fault: two runs that never failed prove nothing about recovery.
The pictures and the lines of text are pure functions of the run's files, tested without a kernel.
"""
from __future__ import annotations

import threading
import time
from html import escape
from typing import Optional

import ipywidgets as W
import torch
from matplotlib.figure import Figure

from labkit.config import Config, load_config
from labkit.fault.inject import FAULT_KINDS
from labkit.fault.recovery import (attempts, expected_overhead, match_recoveries, recovery_report,
                                   same_parameters, young_daly_interval)
from labkit.launcher import Run, open_run
from labkit.metrics.events import read_events
from labkit.plots import OUTPUT_WIDTH_PX, label_axes, render_png
from labkit.widgets.dashboard import RunDashboard
from labkit.widgets.picture import Picture

LAB_STEPS = 300
"""The lab's own run length, quick mode or not: long enough for a person to press Kill rank 1 while it trains
(the scripted cells of notebook 07 run their own, shorter config). The lab says how much training is left."""
POLL_S = 1.0  # how often the lab's watcher reads the run's files: a few small reads, nothing drawn
NO_FAULT = ("No fault happened in this run: no injected fault, no kill, no restart. A clean run of the same "
            "config is the same computation, so matching it bit for bit would prove nothing about recovery. "
            "Start a run with a fault, or press Kill rank 1 while it trains, then compare.")
NO_RESTART = {"straggler": "slower from then on; nothing to recover, no restart",
              "nan": "that step's update was dropped on every rank; no restart"}


# ---------------------------------------------------------------- figures
def recovery_figure(events: list[dict], faults: list[dict]) -> Figure:
    """Left: loss per step, one colour per attempt, faults and checkpoints marked. Right: step against
    wall-clock time — the flat stretch after a fault is the recovery, the steps redone are lost work.
    Drawn at a notebook's output width, so every text is legible as shown."""
    fig = Figure(figsize=(OUTPUT_WIDTH_PX / 100, 4.4), dpi=100, layout="constrained")
    ax_loss, ax_time = fig.subplots(1, 2)
    t0 = min((e["time"] for e in events), default=0.0)
    for i, steps in enumerate(attempts(events)):
        label = "first attempt" if i == 0 else f"after restart {i}"
        ax_loss.plot([e["step"] for e in steps], [e["loss"] for e in steps], lw=2, color=f"C{i}", label=label)
        ax_time.plot([e["time"] - t0 for e in steps], [e["step"] for e in steps], ".-", color=f"C{i}", label=label)
    saves = [e for e in events if e.get("type") == "checkpoint"]
    for j, save in enumerate(saves):
        ax_loss.axvline(save["step"] + 0.5, color="#55A868", lw=1, alpha=0.6, label="checkpoint" if j == 0 else None)
    for f in faults:
        ax_loss.axvline(f["step"], color="#C44E52", lw=2, ls="--", label=f"{f['kind']} (rank {f['rank']})")
        ax_time.axvline(f["time"] - t0, color="#C44E52", lw=2, ls="--", label=f"{f['kind']} (rank {f['rank']})")
        if f.get("recovery_s") is not None:
            ax_time.axvspan(f["time"] - t0, f["time"] - t0 + f["recovery_s"], color="#C44E52", alpha=0.12,
                            label=f"recovery {f['recovery_s']:.1f} s")
    label_axes(ax_loss, "Loss, across the restart", "step", "loss (nats/token)")
    label_axes(ax_time, "Progress over wall-clock time", "seconds since start", "step")
    return fig


def overhead_figure(checkpoint_s: float, mtbf_s: float, measured_interval_s: Optional[float] = None) -> Figure:
    """Expected overhead against the checkpoint interval: saving (δ/τ) + lost work (τ/2M), with
    Young's optimum √(2δM) — δ measured on this machine."""
    best = young_daly_interval(checkpoint_s, mtbf_s)
    taus = [best * 10 ** (k / 20) for k in range(-40, 41)]
    curves = [expected_overhead(t, checkpoint_s, mtbf_s) for t in taus]
    fig = Figure(figsize=(9, 4.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    for key, name in (("saving", "saving  δ/τ"), ("lost_work", "lost work  τ/2M"), ("total", "total")):
        ax.plot(taus, [100 * c[key] for c in curves], lw=3 if key == "total" else 1.5, label=name)
    ax.axvline(best, color="black", ls="--", label=f"Young/Daly √(2δM) = {best:.0f} s")
    if measured_interval_s:
        ax.axvline(measured_interval_s, color="#C44E52", ls=":", lw=2,
                   label=f"this run: every {measured_interval_s:.1f} s")
    ax.set_xscale("log")
    ax.set_ylim(0, min(100, 4 * 100 * expected_overhead(best, checkpoint_s, mtbf_s)["total"]))
    label_axes(ax, f"Checkpoint interval: δ = {checkpoint_s * 1e3:.0f} ms measured, MTBF = {mtbf_s / 60:.0f} min",
               "checkpoint interval τ (s)", "expected overhead (% of time)")
    return fig


# ---------------------------------------------------------------- a run's story, in plain text
def recoverable(config: Config, nproc: int = 2, **overrides) -> Config:
    """``config`` ready to survive a fault: a restart budget of at least 2, faults aimed at rank 1, a collective
    timeout of at most 10 s (a hung rank becomes a restart in seconds, not minutes), then ``overrides``."""
    return config.replace(**{"fault.max_restarts": max(2, config.fault.max_restarts),
                             "fault.inject_rank": min(1, nproc - 1),
                             "comm.timeout_s": min(config.comm.timeout_s, 10.0), **overrides})


def fault_line(fault: dict, live: bool = False) -> str:
    """One fault of :func:`~labkit.fault.recovery.recovery_report`: where it hit and how the run came back."""
    where = f"{fault['kind']} on rank {fault['rank']} at step {fault['step']}"
    if fault.get("recovery_s") is not None:
        return (f"{where}: resumed at step {fault['resumed_at_step']}, {fault['steps_recomputed']} step(s) "
                f"recomputed, recovered in {fault['recovery_s']:.1f} s")
    if fault["kind"] in NO_RESTART:
        return f"{where}: {NO_RESTART[fault['kind']]}"
    return f"{where}: " + ("the elastic agent is restarting the group…" if live else "not recovered")


def progress_text(events: list[dict], faults: list[dict], total_steps: int) -> str:
    """A live run in plain lines: its faults so far, then its step and the training time left at its own pace."""
    lines = [fault_line(f, live=True) for f in faults]
    steps = [e for e in events if e.get("type") == "step"]
    if not steps:
        return "\n".join(lines + ["starting: the workers are joining the group; training begins in a few seconds…"])
    recent = steps[-10:]
    pace = (recent[-1]["time"] - recent[0]["time"]) / (len(recent) - 1) if len(recent) > 1 else None
    done = steps[-1]["step"] + 1
    left = f", about {(total_steps - done) * pace:.0f} s of training left" if pace else ""
    return "\n".join(lines + [f"training: step {done}/{total_steps}{left} — press Kill rank 1 while it runs"])


def saved_config(run: Run) -> Config:
    """The config ``run`` was started with (its ``config.json``), whatever the lab's widgets say now."""
    return load_config(run.run_dir / "config.json")


def outcome_text(run: Run) -> str:
    """How a run ended, in plain lines: its status, its restarts, and where and how fast each fault recovered."""
    summary = run.summary or {}
    head = (f"run {run.status}: {summary.get('steps_completed', 0)} of {saved_config(run).run.steps} steps in "
            f"{summary.get('wall_time_s', 0):.0f} s, {summary.get('restarts', 0)} restart(s)")
    if run.status == "failed" and summary.get("error"):
        head += f" ({summary['error']})"
    faults = recovery_report(run.run_dir)
    quiet = [] if faults or summary.get("restarts") else ["no fault happened: nothing injected, no kill"]
    return "\n".join([head] + [fault_line(f) for f in faults] + quiet)


def over_text(run: Run) -> Optional[str]:
    """What to say when a rank of ``run`` is to be killed but the run is over (None while it trains)."""
    summary = run.summary
    if summary is None and run.status == "running":
        return None
    summary = summary or {}
    return (f"The run is over ({summary.get('status', run.status)} after {summary.get('steps_completed', 0)} "
            "steps): there is no worker left to kill. Press Start run and Kill rank 1 while it trains "
            "(more steps give more time).")


def no_fault_reason(run: Run) -> Optional[str]:
    """Why comparing ``run`` with a clean run would prove nothing (no fault, no restart), or None."""
    records, _ = read_events(run.run_dir / "faults.jsonl")
    return None if any(r.get("type") == "fault" for r in records) or (run.summary or {}).get("restarts") else NO_FAULT


def clean_config(run: Run) -> Config:
    """The config ``run`` trained, without its injected fault: the run that never failed."""
    return saved_config(run).replace(**{"fault.inject": "none"})


def compare_runs(faulted: Run, clean: Run) -> tuple[bool, str]:
    """The two runs' final parameters, bit for bit, with a verdict that names the faults survived."""
    finals = (torch.load(r.run_dir / "final_model.pt", weights_only=True) for r in (faulted, clean))
    same, verdict = same_parameters(*finals)
    faults = recovery_report(faulted.run_dir)
    survived = ", ".join(f"{f['kind']} on rank {f['rank']} at step {f['step']}" for f in faults) or "a restart"
    text = f"{'✔' if same else '✘'} after {survived}: {verdict}"
    if any(f["kind"] == "nan" for f in faults):
        text += " (expected: the NaN step's update was dropped, which a clean run does not do)"
    return same, text


# ---------------------------------------------------------------- the lab
class FaultToleranceLab:
    """Start a run with a fault (or none), kill a rank while it runs, compare with a clean run."""

    def __init__(self, config: Config, nproc: int = 2, steps: int = LAB_STEPS):
        self.base, self.nproc = config, nproc
        self.run: Optional[Run] = None
        self.clean: Optional[Run] = None
        self.dashboard: Optional[RunDashboard] = None
        self._threads: list[threading.Thread] = []
        style, layout = {"description_width": "150px"}, W.Layout(width="460px")
        self.steps = W.IntSlider(steps, min=20, max=max(2000, steps), step=10, description="steps",
                                 style=style, layout=layout)
        self.kind = W.Dropdown(options=list(FAULT_KINDS), value="none", description="injected fault",
                               style=style, layout=layout)
        self.inject_step = W.IntSlider(steps // 2, min=1, max=steps - 1, description="at step", style=style,
                                       layout=layout)
        self.every = W.IntSlider(max(1, steps // 10), min=1, max=steps, description="checkpoint every",
                                 style=style, layout=layout)
        self.steps.observe(self._on_steps, "value")
        self.async_save = W.Checkbox(value=config.fault.async_save, description="async save", style=style)
        self.start_button = W.Button(description="Start run", button_style="primary", icon="play")
        self.kill_button = W.Button(description="Kill rank 1", button_style="danger", icon="bolt")
        self.compare_button = W.Button(description="Compare with a clean run", icon="balance-scale",
                                       layout=W.Layout(width="auto"))
        self.status, self.status_text = W.HTML(), ""
        self.live = W.VBox([Picture("Press Start run: the live dashboard (loss, throughput, restarts) appears here")])
        self.figure = Picture("The recovery chart appears here when a run ends: press Start run, then Kill rank 1")
        self.start_button.on_click(lambda _: self._guarded(self.start))
        self.kill_button.on_click(lambda _: self._guarded(self.kill, 1))
        self.compare_button.on_click(lambda _: self._in_background(self.compare))
        self._say(f"Press Start run: {steps} steps (this lab's own run, long enough to press Kill rank 1 while it "
                  f"trains), a checkpoint every {self.every.value}. Then Kill rank 1 and watch it come back.")

    def config(self, fault: bool = True) -> Config:
        return recoverable(self.base, self.nproc, **{
            "run.steps": self.steps.value, "fault.checkpoint_every": self.every.value,
            "fault.async_save": self.async_save.value, "fault.inject": self.kind.value if fault else "none",
            "fault.inject_step": self.inject_step.value})

    def _on_steps(self, change) -> None:
        self.inject_step.max, self.every.max = change["new"] - 1, change["new"]

    # ---------------------------------------------------------------- saying things
    def _say(self, text: str, error: bool = False) -> None:
        """Show plain ``text`` (its lines kept) in the status line; ``status_text`` keeps it as written."""
        color = "#b00020" if error else "inherit"
        self.status_text = text
        html = "<br>".join(escape(line) for line in text.splitlines())
        self.status.value = f"<div style='font-size:1.15em;color:{color}'>{html}</div>"

    def _guarded(self, action, *args, **kwargs):
        """Button callbacks swallow exceptions: show them in the status line instead."""
        try:
            return action(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 — reported to the user, not hidden
            self._say(str(error), error=True)

    def _in_background(self, action, *args) -> threading.Thread:
        """Run ``action`` in a daemon thread (its exceptions shown in the status line), so the kernel stays free."""
        thread = threading.Thread(target=self._guarded, args=(action, *args), name="labkit-fault-lab", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the lab's background work (following a run, comparing) to end."""
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(timeout)

    # ---------------------------------------------------------------- the buttons
    def start(self) -> Run:
        """Launch the lab's run; the dashboard and a watcher follow it in the background to its end."""
        import labkit

        if self.run is not None and self.run.status == "running":
            raise RuntimeError("a run is still going: let it end (or Kill rank 1) before starting another")
        self.run, self.clean = labkit.launch(self.config(fault=True), nproc=self.nproc), None
        self.start_button.disabled = self.compare_button.disabled = True  # until the run ends
        self.figure.value, self.figure.waiting = b"", "The recovery chart of this run appears here when it ends"
        self.dashboard = RunDashboard("fault-tolerance lab")
        self.live.children = [self.dashboard.widget]
        self.dashboard.follow_in_background(self.run)
        self._say(f"started {self.run.run_dir.name}: {self.kind.value} fault, {self.steps.value} steps, "
                  f"a checkpoint every {self.every.value}")
        self._in_background(self._watch, self.run, self.dashboard)
        return self.run

    def _watch(self, run: Run, dashboard: RunDashboard) -> None:
        """Follow ``run`` to its end: progress and recoveries while it trains, then its outcome and chart."""
        try:
            reader = open_run(run.run_dir)  # its own cursor on the events: the dashboard's thread reads ``run``
            total = saved_config(run).run.steps
            while run.status == "running":
                faults, _ = read_events(run.run_dir / "faults.jsonl")
                events = reader.events()
                self._say(progress_text(events, match_recoveries(faults, events), total))
                time.sleep(POLL_S)
            self._say(outcome_text(run), error=run.status != "finished")  # from its files: the launcher has exited
            self.figure.value = render_png(recovery_figure(reader.events(), recovery_report(run.run_dir)))
            dashboard.join()  # its thread waits for the run (ending every worker) and draws the last picture
        finally:
            self.start_button.disabled = self.compare_button.disabled = False

    def kill(self, rank: int = 1) -> int:
        """SIGKILL ``rank`` of the live run, as a failing node would vanish; returns its pid."""
        if self.run is None:
            raise RuntimeError("no live run: press Start run first")
        try:
            pid = None if over_text(self.run) else self.run.kill_rank(rank)
        except ValueError:  # no live worker: the run ended meanwhile, or its group is (re)starting
            pid = None
        if pid is None:
            raise RuntimeError(over_text(self.run) or f"rank {rank} has no live process right now (the group is "
                               "starting or restarting): try again in a moment")
        self._say(f"SIGKILL sent to rank {rank} (pid {pid}); the elastic agent restarts the group…")
        return pid

    def compare(self) -> tuple[bool, str]:
        """Train the run's config without the fault and compare the final parameters bit for bit — after a fault."""
        import labkit

        if self.run is None:
            raise RuntimeError("no run to compare: press Start run first")
        if self.run.status == "running":
            self._say("waiting for the run to end before comparing…")
        self.join()  # the watcher follows the run to its end and draws its outcome
        self.run.wait()
        self.start_button.disabled = self.compare_button.disabled = True
        try:
            reason = no_fault_reason(self.run)
            if reason:
                self._say(reason)
                return False, reason
            if self.run.status != "finished":
                raise RuntimeError(f"cannot compare: the run {self.run.status}\n{outcome_text(self.run)}")
            self._say("training the same config without a fault…")
            self.clean = labkit.launch(clean_config(self.run), nproc=self.nproc)
            if self.clean.wait() != "finished":
                raise RuntimeError(f"cannot compare: the clean run {self.clean.status}")
            same, verdict = compare_runs(self.run, self.clean)
            self._say(verdict, error=not same)
            return same, verdict
        finally:
            self.start_button.disabled = self.compare_button.disabled = False

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Fault tolerance</h3>"), self.steps, self.kind, self.inject_step, self.every,
                       self.async_save, W.HBox([self.start_button, self.kill_button, self.compare_button]),
                       self.status, self.live, self.figure])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
