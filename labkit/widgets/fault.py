"""The fault-tolerance lab: break a live run on purpose and watch it come back, bit for bit.

``FaultToleranceLab`` starts a 2-process run with checkpoints and a restart budget; its
**Kill rank 1** button sends SIGKILL to a worker, as a failing node would vanish. The elastic agent
restarts the group, the run resumes from its newest valid checkpoint and the loss curve continues.
**Compare with a clean run** trains the same config without the fault and compares the final
parameters bit for bit. The pictures are pure functions of the run's events, tested without a kernel.
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W
import torch
from matplotlib.figure import Figure

from labkit.config import Config
from labkit.fault.inject import FAULT_KINDS
from labkit.fault.recovery import (attempts, expected_overhead, recovery_report, same_parameters,
                                   young_daly_interval)
from labkit.plots import label_axes, render_png
from labkit.widgets.dashboard import RunDashboard


def recovery_figure(events: list[dict], faults: list[dict]) -> Figure:
    """Left: loss per step, one colour per attempt, faults and checkpoints marked. Right: step against
    wall-clock time — the flat stretch after a fault is the recovery, the steps redone are lost work."""
    fig = Figure(figsize=(13, 4.6), dpi=100, layout="constrained")
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
    label_axes(ax_loss, "Loss: the curve continues after the restart", "step", "loss (nats/token)")
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
        ax.axvline(measured_interval_s, color="#C44E52", ls=":", lw=2, label=f"this run: every {measured_interval_s:.1f} s")
    ax.set_xscale("log")
    ax.set_ylim(0, min(100, 4 * 100 * expected_overhead(best, checkpoint_s, mtbf_s)["total"]))
    label_axes(ax, f"Checkpoint interval: δ = {checkpoint_s * 1e3:.0f} ms measured, MTBF = {mtbf_s / 60:.0f} min",
               "checkpoint interval τ (s)", "expected overhead (% of time)")
    return fig


class FaultToleranceLab:
    """Start a run with a fault (or none), kill a rank while it runs, compare with a clean run."""

    def __init__(self, config: Config, nproc: int = 2):
        self.base, self.nproc = config, nproc
        self.run = None
        self.clean = None
        style, layout = {"description_width": "150px"}, W.Layout(width="460px")
        steps = config.run.steps
        self.kind = W.Dropdown(options=list(FAULT_KINDS), value="none", description="injected fault",
                               style=style, layout=layout)
        self.inject_step = W.IntSlider(steps // 2, min=1, max=steps - 1, description="at step", style=style,
                                       layout=layout)
        self.every = W.IntSlider(max(1, config.fault.checkpoint_every or steps // 5), min=1, max=steps,
                                 description="checkpoint every", style=style, layout=layout)
        self.async_save = W.Checkbox(value=config.fault.async_save, description="async save", style=style)
        self.start_button = W.Button(description="Start run", button_style="primary", icon="play")
        self.kill_button = W.Button(description="Kill rank 1", button_style="danger", icon="bolt")
        self.compare_button = W.Button(description="Compare with a clean run", icon="balance-scale")
        self.status = W.HTML()
        self.dashboard = RunDashboard("fault-tolerance lab")
        self.figure = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.start_button.on_click(lambda _: self._guarded(self.start, follow=True))
        self.kill_button.on_click(lambda _: self._guarded(self.kill, 1))
        self.compare_button.on_click(lambda _: self._guarded(self.compare))

    def config(self, fault: bool = True) -> Config:
        return self.base.replace(**{
            "fault.checkpoint_every": self.every.value, "fault.async_save": self.async_save.value,
            "fault.max_restarts": max(2, self.base.fault.max_restarts), "fault.inject_rank": min(1, self.nproc - 1),
            "fault.inject": self.kind.value if fault else "none", "fault.inject_step": self.inject_step.value,
            "comm.timeout_s": min(self.base.comm.timeout_s, 10.0)})

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "inherit"
        self.status.value = f"<div style='font-size:1.15em;color:{color}'>{text}</div>"

    def _guarded(self, action, *args, **kwargs):
        """Button callbacks swallow exceptions: show them in the status line instead."""
        try:
            return action(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 — reported to the user, not hidden
            self._say(f"<b>Failed:</b> {error}", error=True)

    def start(self, follow: bool = False):
        import labkit

        self.run = labkit.launch(self.config(fault=True), nproc=self.nproc)
        self._say(f"started {self.run.run_dir.name}: {self.kind.value} fault, checkpoint every {self.every.value} steps")
        if follow:
            self.dashboard.follow_in_background(self.run)
        return self.run

    def kill(self, rank: int = 1) -> int:
        if self.run is None or self.run.status != "running":
            raise RuntimeError("no live run: press Start run first")
        pid = self.run.kill_rank(rank)
        self._say(f"SIGKILL sent to rank {rank} (pid {pid}); the elastic agent restarts the group…")
        return pid

    def wait(self) -> dict:
        status = self.run.wait()
        self.dashboard.join()
        faults = recovery_report(self.run.run_dir)
        self.figure.value = render_png(recovery_figure(self.run.events(), faults))
        summary = self.run.summary or {}
        lines = [f"run {status} after {summary.get('restarts', 0)} restart(s)"]
        lines += [f"{f['kind']} on rank {f['rank']} at step {f['step']}: resumed at step {f['resumed_at_step']}, "
                  f"{f['steps_recomputed']} step(s) recomputed, recovered in {f['recovery_s']:.1f} s"
                  for f in faults if f.get("recovery_s") is not None]
        self._say("<br>".join(lines))
        return summary

    def compare(self) -> tuple[bool, str]:
        import labkit

        if self.run is None:
            raise RuntimeError("no run to compare: press Start run first")
        if self.run.status == "running":
            self.wait()
        self._say("training the same config without a fault…")
        self.clean = labkit.launch(self.config(fault=False), nproc=self.nproc)
        if self.clean.wait() != "finished" or self.run.status != "finished":
            raise RuntimeError(f"cannot compare: faulted run {self.run.status}, clean run {self.clean.status}")
        finals = (torch.load(r.run_dir / "final_model.pt", weights_only=True) for r in (self.run, self.clean))
        same, verdict = same_parameters(*finals)
        self._say(("✔ " if same else "✘ ") + verdict)
        return same, verdict

    def widget(self) -> W.Widget:
        return W.VBox([W.HTML("<h3>Fault tolerance</h3>"), self.kind, self.inject_step, self.every, self.async_save,
                       W.HBox([self.start_button, self.kill_button, self.compare_button]), self.status,
                       self.dashboard.widget, self.figure])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
