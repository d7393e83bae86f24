"""Record the runs that ``labkit.replay`` plays back, for rooms without the time or the cores to train live.

Each recording is a real run of this repository, trained here by the same ``labkit.launch`` a notebook
uses, then trimmed to what the dashboards read: ``events.jsonl`` (every step, checkpoint, restart, end),
``summary.json``, ``config.json`` and ``launch.json``, and ``faults.jsonl`` where a fault was recorded.
Checkpoints and pid files are left out. Beside them, ``meta.json`` says what a replay must say on screen:
the machine it was recorded on (:func:`labkit.results.machine_fingerprint`), the date, the commit, and how
busy the machine was (its load average before and after, with a note).

    python datasets/recorded_runs/record.py                     # every recording, one after another
    python datasets/recorded_runs/record.py quickstart 01_cap_async --note "idle machine"

A recording is made from a clean checkout on a quiet machine, or not at all: uncommitted changes to tracked
files (the recordings' own folders aside) are refused before anything trains, and so is a 1-minute load
average of 1 or more once ``--wait-quiet`` seconds have passed waiting for it to fall (``--allow-busy``
records anyway and says so in ``meta.json``; ``tests/test_recordings.py`` fails on such a recording).
Re-running replaces a recording whole. The runs are the registry ``RECORDINGS`` below; a slow lab's run
is taken from the lab's own notebook: its first code cell is executed (outside quick mode) and the run is
built from the objects it made, so the numbers of the config are written once, in the notebook.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # this checkout's labkit, not the one an editable install points at

import labkit  # noqa: E402
from labkit.files import write_json  # noqa: E402
from labkit.results import describe_machine, git_commit, machine_fingerprint  # noqa: E402

KEEP = ("summary.json", "config.json", "launch.json", "faults.jsonl")
"""The files of a run directory a dashboard or a recovery report reads, shipped as they are; ``events.jsonl``
is shipped too, gzipped (``events.jsonl.gz``: a 600-step run's 1.2 MB of JSON lines is 0.17 MB, every number
at full precision)."""
FOLDERS = ("cap",)
"""A lab's own records in a run directory, their JSON lines shipped: ``cap/`` (a consistency run's per-worker
progress and server updates, what notebook 01's progress picture reads). Its replica snapshots
(``params_rank*.pt``, every parameter at every snapshot: 95 MB for 8 s of ``async``) are left out."""
NPROC = 2
KILL_AT_STEP = 60
QUIET_LOAD = 1.0
"""A recording starts only below this 1-minute load average (on 2 cores: no other run beside it)."""
NOTEBOOKS = REPO / "notebooks"


class Refused(SystemExit):
    """Why nothing was recorded: said before anything trains."""


@dataclass(frozen=True)
class Recording:
    """A run to record: ``make()`` gives its config and process count; ``what`` says which run it is."""
    make: Callable[[], tuple]
    what: str
    kill_at_step: Optional[int] = None
    notebook: Optional[str] = None  # the notebook whose replay cell plays it (a slow lab's)


# ---------------------------------------------------------------- the runs
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


def notebook_setup(stem: str) -> dict:
    """The names a lab notebook's first code cell defines, executed as the notebook runs it (from notebooks/, not
    in quick mode): the lab's own config and panels, so a recording repeats no number of the notebook."""
    cells = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]
    source = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    namespace: dict = {"__name__": f"notebook_{stem}"}
    with contextlib.chdir(NOTEBOOKS), contextlib.redirect_stdout(sys.stderr):
        exec(compile(source, f"{stem}.ipynb: first code cell", "exec"), namespace)  # noqa: S102 — our own notebook
    return namespace


def cap_async():
    """Notebook 01's first run (``lab.run("async")``): worker 1 cut off for a third of the run."""
    from labkit.consistency.lab import processes_for

    lab = notebook_setup("01_cap_tradeoffs")["lab"]
    return lab.config("async"), processes_for("async", lab.settings("async")["workers"])


def data_parallel(strategy: str):
    """Notebook 02's comparison, one strategy of it, as ``compare_strategies`` runs it."""
    def make():
        lab = notebook_setup("02_data_parallel")["lab"]
        config = lab.config().replace(**{"parallel.dp.strategy": strategy, "run.name": f"dp-{strategy}"})
        return config, lab.nproc.value
    return make


def tensor_parallel():
    """Notebook 03's live tensor-parallel run: tp = 2, 2 micro-batches (its first point)."""
    from labkit.widgets import model_parallel as mp

    setup = notebook_setup("03_model_parallel")
    config, nproc = setup["config"], setup["nproc"]
    _, overrides = mp.layout_point(config, nproc, tp=2, m=2)
    return config.replace(**overrides), nproc


def fast_link_baseline():
    """Notebook 04's first run: no compression on the fast link, the run that measures the compute."""
    from labkit.widgets.network_lesson import FAST_LINK_GBPS, LATENCY_US, bandwidth_settings

    lab = notebook_setup("04_communication")["lab"]
    _, overrides = bandwidth_settings([FAST_LINK_GBPS], ["none"], LATENCY_US)[0]
    return lab.base.replace(**overrides), lab.nproc


def scaling_point():
    """Notebook 08's live point in quick mode (the middle size at the third token budget of the sweep's grid)."""
    from labkit.scaling.sweep import SweepSpec, config_overrides

    spec = SweepSpec.load(REPO / "configs" / "scaling" / "bigram.yaml")
    spec.sizes, spec.tokens, spec.isoflops = spec.sizes[1:2], [spec.tokens[2]], []
    (_, overrides), = spec.points()
    return spec.base.replace(**config_overrides(overrides)), spec.nproc


def slow_link_baseline():
    """Notebook 09's loop, its first trial: the baseline on the emulated slow link."""
    return notebook_setup("09_optimization_loop")["config"], NPROC


def capstone_baseline():
    """Notebook 11's baseline (``capstone.run_attempt`` of ``configs/capstone_slow.yaml``)."""
    from labkit.workshop import capstone

    config = notebook_setup("11_capstone")["config"]
    return config.replace(**{"run.name": capstone.BASELINE_NAME}), NPROC


RECORDINGS = {
    "quickstart": Recording(lambda: (quickstart_config(), NPROC),
                            "notebook 00: configs/quickstart.yaml, full size, 2 processes"),
    "fault_restart": Recording(lambda: (fault_config(), NPROC),
                               f"notebook 07: rank 1 killed (SIGKILL) at step {KILL_AT_STEP}; the elastic agent "
                               "restarts the group from its checkpoint", kill_at_step=KILL_AT_STEP),
    "01_cap_async": Recording(cap_async, "notebook 01: async, worker 1 cut off for a third of the run",
                              notebook="01_cap_tradeoffs"),
    "02_ddp_naive": Recording(data_parallel("ddp_naive"), "notebook 02: ddp_naive, one blocking all-reduce per "
                              "parameter after backward (the most exposed communication)", notebook="02_data_parallel"),
    "02_ddp_bucketed": Recording(data_parallel("ddp_bucketed"), "notebook 02: ddp_bucketed, buckets all-reduced "
                                 "inside backward", notebook="02_data_parallel"),
    "03_tensor_parallel": Recording(tensor_parallel, "notebook 03: the live tensor-parallel run (tp = 2, m = 2)",
                                    notebook="03_model_parallel"),
    "04_fast_link": Recording(fast_link_baseline, "notebook 04: the sweep's first run, no compression on the "
                              "fast link (it measures the compute)", notebook="04_communication"),
    "08_scaling_point": Recording(scaling_point, "notebook 08: one live point of the bigram sweep, against the law",
                                  notebook="08_scaling_laws"),
    "09_slow_link": Recording(slow_link_baseline, "notebook 09: the optimisation loop's baseline on the emulated "
                              "slow link", notebook="09_optimization_loop"),
    "11_capstone_baseline": Recording(capstone_baseline, "notebook 11: the capstone's baseline, "
                                      "configs/capstone_slow.yaml", notebook="11_capstone"),
}


# ---------------------------------------------------------------- refusals, before anything trains
def changed_files(repo: Path = REPO) -> Optional[list[str]]:
    """Tracked files that differ from HEAD, what record.py writes aside (the recordings' folders, the README's
    table); None outside a git checkout."""
    written = [*RECORDINGS, "README.md"]
    mine = [f":(exclude){HERE.relative_to(repo) / name}" for name in written] if HERE.is_relative_to(repo) else []
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *mine],
                              cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def check_clean(changed: Optional[list[str]]) -> None:
    """Refuse a checkout with uncommitted changes (a recording must come from code a commit holds)."""
    if changed is None:
        raise Refused("refused: not a git checkout (or git failed), so no commit would say what was recorded")
    if changed:
        raise Refused("refused: the checkout has uncommitted changes, so no commit holds the code that would be "
                      "recorded; commit or stash them, or record from a clean clone:\n  " + "\n  ".join(changed[:20]))


def wait_quiet(wait_s: float, allow_busy: bool, load: Callable[[], tuple] = os.getloadavg,
               sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print) -> tuple:
    """The load averages once the 1-minute one is below ``QUIET_LOAD``, waiting up to ``wait_s`` seconds for it
    (a recording just made raises it); still busy then: refused, or with ``allow_busy`` the busy readings."""
    waited, readings = 0.0, load()
    while readings[0] >= QUIET_LOAD and waited < wait_s:
        if waited == 0:
            say(f"  waiting for the 1-minute load average ({readings[0]:.2f}) to fall below {QUIET_LOAD:g}…")
        sleep(5.0)
        waited, readings = waited + 5.0, load()
    if readings[0] >= QUIET_LOAD and not allow_busy:
        raise Refused(f"refused: the 1-minute load average is {readings[0]:.2f} (≥ {QUIET_LOAD:g}) after waiting "
                      f"{waited:.0f} s: something else is using the cores, and its time would be recorded as the "
                      "run's. Stop it, or pass --allow-busy (meta.json then says so and the tests fail on it)")
    return tuple(round(x, 2) for x in readings)


# ---------------------------------------------------------------- recording
def train(config, run_dir: Path, nproc: int = NPROC, kill_at_step=None) -> labkit.Run:
    """Train ``config`` on ``nproc`` processes into ``run_dir``; with ``kill_at_step``, SIGKILL rank 1 there."""
    run = labkit.launch(config, nproc=nproc, run_dir=run_dir)
    if kill_at_step is not None:
        while len(run.metrics["step"]) < kill_at_step and run.status == "running":
            time.sleep(0.2)
        run.kill_rank(1)
    run.wait()
    return run


def record(name: str, note: str = "", load_before: tuple = (), allow_busy: bool = False) -> Path:
    """Train recording ``name`` in a temporary directory, then ship its dashboard files and ``meta.json``."""
    recording = RECORDINGS[name]
    config, nproc = recording.make()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix=f"labkit-record-{name}-") as tmp:
        run = train(config, Path(tmp) / name, nproc, recording.kill_at_step)
        status = run.status
        if status != "finished":
            raise SystemExit(f"{name}: the run ended {status}, not finished; nothing recorded\n{run.log()[-2000:]}")
        target = ship(run.run_dir, HERE / name)
    machine = machine_fingerprint()
    write_json(target / "meta.json", {
        "name": name, "what": recording.what, "notebook": recording.notebook, "date": started, "nproc": nproc,
        "status": status, "machine": machine, "machine_text": describe_machine(machine), "commit": git_commit(),
        "uncommitted_changes": bool(changed_files()), "load_before": list(load_before),
        "load_after": [round(x, 2) for x in os.getloadavg()], "allow_busy": allow_busy, "note": note,
        "recorded_by": "datasets/recorded_runs/record.py"})
    return target


def ship(run_dir: Path, target: Path) -> Path:
    """Replace ``target`` with ``run_dir``'s dashboard files; the events gzipped, reproducibly (no timestamp)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for file in KEEP:
        if (run_dir / file).exists():
            shutil.copy2(run_dir / file, target / file)
    for folder in FOLDERS:
        for records in sorted((run_dir / folder).glob("*.jsonl")):
            (target / folder).mkdir(exist_ok=True)
            shutil.copy2(records, target / folder / records.name)
    with gzip.GzipFile(target / "events.jsonl.gz", "wb", compresslevel=9, mtime=0) as out:
        out.write((run_dir / "events.jsonl").read_bytes())
    return target


# ---------------------------------------------------------------- the README's table, from the recordings
TABLE_START = "<!-- the table of recordings: record.py writes it from each meta.json and summary.json -->"
TABLE_END = "<!-- end of the table -->"


def table_row(folder: Path) -> str:
    """One recording's line of the README's table, from its own files."""
    from labkit.recordings import events_file, load_events

    meta, summary = (json.loads((folder / f).read_text(encoding="utf-8")) for f in ("meta.json", "summary.json"))
    steps = sum(e["type"] == "step" for e in load_events(events_file(folder)))
    steps = steps or sum(len(p.read_text().splitlines()) for p in folder.glob("cap/worker*.jsonl"))  # every worker's
    wall, restarts = summary.get("wall_time_s", summary.get("wall_s")), summary.get("restarts")
    ended = f"{summary.get('status')}, {wall:.0f} s" if isinstance(wall, (int, float)) else str(summary.get("status"))
    ended += f", {restarts} restart{'s' * (restarts != 1)}" if restarts else ""
    clean = "clean" if meta.get("uncommitted_changes") is False else "**uncommitted changes**"
    load = meta.get("load_before") or ["?"]
    return (f"| `{folder.name}` | {meta.get('what', '')} | {meta.get('nproc', '?')} | {steps} | {ended} | "
            f"{str(meta.get('date', '?'))[:10]}, `{str(meta.get('commit', '?'))[:10]}` ({clean}) | {load[0]} |")


def readme_table(root: Path = HERE) -> str:
    """The README's table of every shipped recording (a folder here with events), by name."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("events.jsonl*")))
    return "\n".join(["| name | what | processes | steps | ended | recorded (commit) | 1-min load before |",
                      "|---|---|---|---|---|---|---|", *(table_row(f) for f in folders)])


def write_readme_table(readme: Path = HERE / "README.md") -> None:
    """Replace the table between the README's markers with :func:`readme_table`."""
    text = readme.read_text(encoding="utf-8")
    before, rest = text.split(TABLE_START)
    _, after = rest.split(TABLE_END)
    readme.write_text(f"{before}{TABLE_START}\n{readme_table(readme.parent)}\n{TABLE_END}{after}", encoding="utf-8")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"which to record: {', '.join(RECORDINGS)} (default: all)")
    parser.add_argument("--note", default="", help="anything the numbers depend on, e.g. what else ran")
    parser.add_argument("--wait-quiet", type=float, default=180.0, metavar="S",
                        help="seconds to wait before each recording for the 1-minute load to fall below 1")
    parser.add_argument("--allow-busy", action="store_true",
                        help="record even at a load of 1 or more (meta.json says so; the tests fail on it)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in RECORDINGS]
    if unknown:
        parser.error(f"no recording named {', '.join(unknown)}; choose from {', '.join(RECORDINGS)}")
    return args


def main(argv=None, changed: Callable[[], Optional[list[str]]] = changed_files, **quiet) -> list[str]:
    """Record the names asked for (all by default), in turn; ``changed`` and ``quiet`` (``wait_quiet``'s load and
    sleep) let a test stand in for git and the load average. Returns the names recorded."""
    args = parse(argv)
    if labkit.QUICK:
        raise Refused("refused: LABKIT_QUICK=1 is set; a recording is the full-size run. Unset it")
    if Path(labkit.__file__).resolve().parents[1] != REPO:
        raise Refused(f"refused: labkit is imported from {labkit.__file__}, not from this checkout ({REPO})")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # workers
    names = args.names or list(RECORDINGS)
    done = []
    for i, name in enumerate(names, 1):
        check_clean(changed())
        print(f"[{i}/{len(names)}] {name}: {RECORDINGS[name].what}", flush=True)
        load_before = wait_quiet(args.wait_quiet, args.allow_busy, **quiet)
        started = time.monotonic()
        target = record(name, args.note, load_before, args.allow_busy)
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        print(f"[{i}/{len(names)}] {name}: {target.relative_to(REPO)} ({size / 1024:.0f} KB) in "
              f"{time.monotonic() - started:.0f} s, load before {load_before[0]}", flush=True)
        done.append(name)
        write_readme_table()
    return done


if __name__ == "__main__":
    main()
