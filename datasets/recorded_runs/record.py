"""Record the runs that ``labkit.replay`` plays back, for rooms without the time or the cores to train live.

Each recording is a real run of this repository, trained here by the same ``labkit.launch`` a notebook
uses, then trimmed to what the dashboards read: ``events.jsonl`` (every step, checkpoint, restart, end),
``summary.json``, ``config.json`` and ``launch.json``, and ``faults.jsonl`` where a fault was recorded.
Checkpoints and pid files are left out. Beside them, ``meta.json`` says what a replay must say on screen:
the machine it was recorded on (:func:`labkit.results.machine_fingerprint`), the date, the commit, and how
busy the machine was (its load average before and after, with a note).

    python datasets/recorded_runs/record.py                     # both recordings
    python datasets/recorded_runs/record.py quickstart --note "the test suite ran beside it"

Re-running replaces a recording whole. The runs:

* ``quickstart``: notebook 00's run, ``configs/quickstart.yaml`` at full size, 2 processes.
* ``fault_restart``: notebook 07's run (``recoverable`` quickstart, 120 steps, a checkpoint every 10);
  rank 1 is killed with SIGKILL from outside at step ``KILL_AT_STEP`` and torchrun's elastic agent restarts
  the group, which resumes from the newest checkpoint.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

import labkit  # noqa: E402
from labkit.files import write_json  # noqa: E402
from labkit.results import describe_machine, git_commit, machine_fingerprint, uncommitted_changes  # noqa: E402

KEEP = ("summary.json", "config.json", "launch.json", "faults.jsonl")
"""The files of a run directory a dashboard or a recovery report reads, shipped as they are; ``events.jsonl``
is shipped too, gzipped (``events.jsonl.gz``: a 600-step run's 1.2 MB of JSON lines is 0.17 MB, every number
at full precision)."""
NPROC = 2
KILL_AT_STEP = 60


def quickstart_config():
    """Notebook 00's run as a room would train it: the shipped config, unchanged (not quick mode)."""
    return labkit.load_config(REPO / "configs" / "quickstart.yaml")


def fault_config():
    """Notebook 07's own run (its first code cell, outside quick mode), ready to survive a kill."""
    from labkit.widgets.fault import recoverable

    config = quickstart_config().replace(**{
        "run.name": "fault-lab", "run.steps": 120, "run.eval_every": 0, "model.n_embd": 64,
        "fault.checkpoint_every": 10, "fault.max_restarts": 2})
    return recoverable(config, nproc=NPROC)


def train(config, run_dir: Path, kill_at_step=None) -> labkit.Run:
    """Train ``config`` on ``NPROC`` processes into ``run_dir``; with ``kill_at_step``, SIGKILL rank 1 there."""
    run = labkit.launch(config, nproc=NPROC, run_dir=run_dir)
    if kill_at_step is not None:
        while len(run.metrics["step"]) < kill_at_step and run.status == "running":
            time.sleep(0.2)
        run.kill_rank(1)
    run.wait()
    return run


RECORDINGS = {
    "quickstart": (quickstart_config, None, "notebook 00: configs/quickstart.yaml, full size, 2 processes"),
    "fault_restart": (fault_config, KILL_AT_STEP, f"notebook 07: rank 1 killed (SIGKILL) at step {KILL_AT_STEP}; "
                                                  "the elastic agent restarts the group from its checkpoint"),
}


def record(name: str, note: str = "") -> Path:
    """Train recording ``name`` in a temporary directory, then ship its dashboard files and ``meta.json``."""
    make_config, kill_at_step, what = RECORDINGS[name]
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix=f"labkit-record-{name}-") as tmp:
        run = train(make_config(), Path(tmp) / name, kill_at_step)
        status = run.status
        if status != "finished":
            raise SystemExit(f"{name}: the run ended {status}, not finished; nothing recorded\n{run.log()[-2000:]}")
        target = ship(run.run_dir, HERE / name)
    machine = machine_fingerprint()
    write_json(target / "meta.json", {
        "name": name, "what": what, "date": started, "nproc": NPROC, "status": status,
        "machine": machine, "machine_text": describe_machine(machine), "commit": git_commit(),
        "uncommitted_changes": uncommitted_changes(), "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()], "note": note,
        "recorded_by": "datasets/recorded_runs/record.py"})
    return target


def ship(run_dir: Path, target: Path) -> Path:
    """Replace ``target`` with ``run_dir``'s dashboard files; the events gzipped, reproducibly (no timestamp)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for file in KEEP:
        if (run_dir / file).exists():
            shutil.copy2(run_dir / file, target / file)
    with gzip.GzipFile(target / "events.jsonl.gz", "wb", compresslevel=9, mtime=0) as out:
        out.write((run_dir / "events.jsonl").read_bytes())
    return target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"which to record: {', '.join(RECORDINGS)} (default: all)")
    parser.add_argument("--note", default="", help="anything the numbers depend on, e.g. what else ran")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in RECORDINGS]
    if unknown:
        parser.error(f"no recording named {', '.join(unknown)}; choose from {', '.join(RECORDINGS)}")
    for name in args.names or RECORDINGS:
        target = record(name, args.note)
        size = sum(f.stat().st_size for f in target.iterdir())
        print(f"{name}: {target.relative_to(REPO)} ({size / 1024:.0f} KB)", json.dumps(
            json.loads((target / "summary.json").read_text()).get("wall_time_s")))


if __name__ == "__main__":
    main()
