"""Notebook 07's restart-or-heal section: one worker SIGKILLed mid-run, recovered two ways, side by side.

* **Restart** (labkit's path, :mod:`labkit.fault.recovery`): the elastic agent stops every worker and starts them
  all again from the newest checkpoint. :func:`restart_row` reads it from a run killed from outside.
* **Live heal** (torchft, :mod:`labkit.fault.heal`): the other replica group keeps stepping; the killed one is
  started again and copies the live peer's weights. :func:`heal_beside` runs it on the restart run's model (its
  shape, its batch per rank, each step padded to its measured step time) with the kill at the same step, the
  lighthouse on 127.0.0.1, and returns both rows: seconds from the kill to training again, steps of work lost, and
  the steps the others kept doing meanwhile.
* :func:`shipped_heal_table`: ``benchmarks/heal.py``'s medians on a 10M-parameter model, from
  ``benchmarks/results/heal.jsonl``, with where they come from.

Every number shown is read from a run's files or the results file.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from matplotlib.figure import Figure

from labkit.fault.heal import HealSpec, heal_run, read_events as heal_events
from labkit.fault.recovery import recovery_report
from labkit.metrics.events import read_events
from labkit.plots import OUTPUT_WIDTH_PX, label_axes
from labkit.results import markdown_table

NAME = "heal"  # benchmarks/results/heal.jsonl
RESTART = "restart every worker (labkit)"
HEAL = "heal one replica live (torchft)"
COLUMNS = [("recovery", "path", "s"), ("kill → training again (s)", "recovery_s", ".2f"),
           ("seen after (s)", "detected_s", ".2f"), ("steps of work lost", "steps_lost", "g"),
           ("steps the others kept meanwhile", "others_steps", "g")]


def torchft_missing() -> Optional[str]:
    """Why the live heal cannot run here (torchft is not installed), or None if it can."""
    if importlib.util.find_spec("torchft") is None:
        return ("torchft is not installed here, so the live heal does not run: install the ft extra "
                "(pip install -e '.[ft]'). The table below is the shipped measurement.")
    return None


def restart_row(run_dir) -> dict:
    """The restart path's recovery of the first fault of a run killed from outside: kill → first step after the
    resume, the steps done again, and the steps the surviving ranks logged after the kill that the resume kept
    (steps past the checkpoint are all done again: none)."""
    run_dir = Path(run_dir)
    faults = recovery_report(run_dir)
    if not faults or faults[0]["recovery_s"] is None:
        raise ValueError(f"{run_dir} has no fault it recovered from: kill a rank of a run with checkpoints first")
    fault = faults[0]
    events, _ = read_events(run_dir / "events.jsonl")
    resume = next(e for e in events if e["type"] == "resume" and e["time"] > fault["time"])
    kept = [e for e in events if e["type"] == "step" and fault["time"] < e["time"] < resume["time"]
            and e["step"] < resume["next_step"]]
    return {"path": RESTART, "step": fault["step"], "resumed_at_step": fault["resumed_at_step"],
            "recovery_s": fault["recovery_s"],
            "detected_s": fault["detected_s"], "steps_lost": fault["steps_recomputed"], "others_steps": len(kept)}


def heal_spec_like(run_dir, steps_after: int) -> HealSpec:
    """A heal of the restart run's fault: its model (shape from ``config.json``, vocabulary from its start event), its
    sequences per rank per step, each step at least its median step time, the kill at the step it struck, and the
    killed group started again at once (as the agent restarts workers)."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    events, _ = read_events(run_dir / "events.jsonl")
    start = next(e for e in events if e["type"] == "start")
    steps = [e["step_time_s"] for e in events if e["type"] == "step"]
    model = {"vocab_size": start["vocab_size"], **{k: config["model"][k] for k in
                                                   ("block_size", "n_layer", "n_head", "n_embd")}}
    fault = recovery_report(run_dir)[0]
    return HealSpec(replicas=start["world_size"], victim=fault["rank"], kill_at=max(1, fault["step"]),
                    solo_steps=0, steps_after=steps_after, model=model,
                    batch=config["data"]["batch_size"] // start["world_size"], seed=config["run"]["seed"],
                    min_step_s=statistics.median(steps))


def heal_row(split: dict, spec: HealSpec) -> dict:
    """The live heal's recovery (:func:`labkit.fault.heal.recovery_split`) in the restart row's terms: the steps lost
    are the healthy group's uncommitted ones (the killed group loses none: it takes the peer's current weights)."""
    return {"path": HEAL, "step": spec.kill_at, "recovery_s": split["total_s"], "detected_s": split["detect_s"],
            "steps_lost": split["healthy_steps_dropped"], "others_steps": split["healthy_steps_meanwhile"]}


def heal_beside(run, steps_after: int = 5, root=None, timeout_s: float = 300.0) -> dict:
    """Heal the fault of ``run`` (a labkit run, killed from outside and restarted) live with torchft, on the same
    model; returns both rows, the markdown table of them, the heal's spec and its events' directory."""
    restart = restart_row(run.run_dir)
    spec = heal_spec_like(run.run_dir, steps_after)
    if root is None:  # a fresh directory each time: heal_run appends to its events
        root = tempfile.mkdtemp(prefix=f"{Path(run.run_dir).name}-heal-", dir=Path(run.run_dir).parent)
    root = Path(root)
    split = heal_run(spec, root, timeout_s=timeout_s)
    rows = [restart, heal_row(split, spec)]
    return {"rows": rows, "table": markdown_table(rows, COLUMNS), "spec": asdict(spec), "split": split,
            "heal_dir": str(root), "run_dir": str(run.run_dir)}


# ---------------------------------------------------------------- the picture

def progress_after_kill(side: dict) -> dict:
    """Step against seconds since the kill, per process: the restart run's rank 0 (every attempt), and each torchft
    replica group's committed steps; with each path's kill → training-again seconds."""
    run_dir, heal_dir = Path(side["run_dir"]), Path(side["heal_dir"])
    fault = recovery_report(run_dir)[0]
    events, _ = read_events(run_dir / "events.jsonl")
    restart = [(e["time"] - fault["time"], e["step"]) for e in events if e["type"] == "step"]
    healed = heal_events(heal_dir / "events.jsonl")
    kill = next(e["at"] for e in healed if e["type"] == "kill")
    groups: dict[str, list] = {}
    for e in healed:
        if e["type"] == "step" and e["committed"]:
            who = f"replica {e['replica']}" + (" (started again)" if e.get("life") else "")
            groups.setdefault(who, []).append((e["t"] - kill, e["step"]))
    return {"restart": restart, "heal": groups,
            "recovery_s": {row["path"]: row["recovery_s"] for row in side["rows"]}}


def heal_figure(side: dict) -> Figure:
    """Left: the restart path: rank 0's steps over time, the flat stretch after the kill is every worker waiting.
    Right: the live heal: the healthy group's steps go on through the kill; the killed group's new process joins
    at the peer's step. Time 0 is the kill on both."""
    progress = progress_after_kill(side)
    fig = Figure(figsize=(OUTPUT_WIDTH_PX / 100, 4.2), dpi=100, layout="constrained")
    ax_restart, ax_heal = fig.subplots(1, 2, sharey=False)
    ax_restart.plot(*zip(*progress["restart"]), ".", color="C0", label="rank 0's steps")
    for i, (who, points) in enumerate(sorted(progress["heal"].items())):
        ax_heal.plot(*zip(*points), ".-" if "again" in who else ".", color=f"C{i}", label=who)
    for ax, path in ((ax_restart, RESTART), (ax_heal, HEAL)):
        ax.axvline(0, color="#C44E52", lw=2, ls="--", label="SIGKILL")
        ax.axvspan(0, progress["recovery_s"][path], color="#C44E52", alpha=0.12,
                   label=f"kill → training again: {progress['recovery_s'][path]:.1f} s")
    label_axes(ax_restart, "Restart: every worker from the checkpoint", "seconds since the kill", "step")
    label_axes(ax_heal, "Live heal: the other group keeps stepping", "seconds since the kill", "step")
    return fig


# ---------------------------------------------------------------- the shipped measurement

def shipped_rows(record: dict, restart_rounds: Optional[dict] = None) -> list[dict]:
    """The ``heal`` table's medians as rows: the restart path's (its detection, the median of ``restart_rounds``'s,
    when given), then each heal's (new process, warm standby)."""
    first = record["rows"][0]
    seen = [r["detected_s"] for r in (restart_rounds or {}).get("rows", []) if r.get("detected_s") is not None]
    rows = [{"path": RESTART, "recovery_s": first.get("median_restart_recovery_s"),
             "detect_s": statistics.median(seen) if seen else None,
             "respawn_s": None, "quorum_s": None, "transfer_s": None, "rejoin_s": None,
             "steps_lost": first.get("median_restart_steps_recomputed"), "others_steps": None}]
    for row in record["rows"]:
        rows.append({"path": f"{HEAL}, {'warm standby' if row['standby'] else 'new process'}",
                     "recovery_s": row["median_total_s"], "detect_s": row["median_detect_s"],
                     "respawn_s": row["median_respawn_s"], "quorum_s": row["median_quorum_s"],
                     "transfer_s": row["median_transfer_s"], "rejoin_s": row["median_rejoin_s"],
                     "steps_lost": row["median_healthy_steps_dropped"],
                     "others_steps": row["median_healthy_steps_meanwhile"]})
    return rows


SHIPPED_COLUMNS = [("recovery (median)", "path", "s"), ("kill → training again (s)", "recovery_s", ".2f"),
                   ("detect", "detect_s", ".2f"), ("respawn", "respawn_s", ".2f"), ("quorum", "quorum_s", ".2f"),
                   ("transfer", "transfer_s", ".2f"), ("rejoin", "rejoin_s", ".2f"),
                   ("steps of work lost", "steps_lost", "g"), ("steps the others kept", "others_steps", "g")]


def shipped_heal_table() -> str:
    """``benchmarks/heal.py``'s newest medians as markdown, with the file, commit, machine and rounds; or a line
    saying there are none."""
    from labkit.results import latest, load_results, provenance, results_path

    if not results_path(NAME).exists():
        return f"No shipped measurement: `{results_path(NAME).name}` is missing (run `benchmarks/heal.py`)."
    records = load_results(NAME)
    record = latest(records, "heal")
    restart = next((r for r in records if r["table"] == "restart_rounds" and r["commit"] == record["commit"]
                    and r["date"] == record["date"]), None)
    settings = record["settings"]
    params = ", ".join(f"{k} {v}" for k, v in settings["model"].items())
    note = (f"Medians of {record['rows'][0]['rounds']} rounds per path, {settings['replicas']} processes, GPT "
            f"({params}); the restart path's rows hold its recovery and the steps it did again (its other workers "
            f"stop: nothing kept); load average {settings['load_average_at_start']:.1f} at the start on "
            f"{settings['cores']} cores.")
    return "\n\n".join([markdown_table(shipped_rows(record, restart), SHIPPED_COLUMNS), note,
                        "Source: " + provenance(record, results_path(NAME))])
