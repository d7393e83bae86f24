"""What does the live dashboard cost the run it watches?

The dashboard draws on the same cores as the workers: on a 2-core machine every CPU second it spends drawing is
taken from a worker, and since the ranks step in lock-step, the other rank waits for it. This benchmark runs the
same 2-process run (notebook 00's configuration) with nothing watching it (``bare``) and with a
:class:`~labkit.widgets.dashboard.RunDashboard` following it (``dashboard``), interleaved A B, B A, … so drifts in
machine load hit both alike, and reports the throughput ratio dashboard / bare per round (target ≥ 0.97: the
dashboard costs at most 3%).

Throughput is the run summary's tokens/s (total tokens over total time of the steady-state steps, the
definition the dashboard's headline uses too). For the dashboard runs it also records the frames drawn while the
run went (``live_frames``; the last one is drawn after it) and the redraws skipped, the CPU seconds drawing took
(the painter's, at the lowest priority, and the last frame's) and the follow loop's own in this process, and the
median speed of the steps that overlapped a live redraw against the others' (the sawtooth: near 1, drawing no
longer shows in the curve). On a machine others load, compare the CPU seconds with the run's: a ratio within the
run-to-run noise cannot say more.
Each run's 1-minute load average is recorded before it starts.

    .venv/bin/python benchmarks/dashboard_cost.py [--rounds 4] [--steps 300] [--every 2] [--quick]

**With a browser** (``--browser``, 24 rounds unless told otherwise; what ``make benchmark`` runs): JupyterLab in
Debian's chromium (``tests/browser/browser_lab.py``), a notebook with one cell that the benchmark rewrites and runs
once per run, so every run is launched from the notebook's kernel as in a workshop: ``bare`` waits for the run
with nothing drawing, ``dashboard`` follows it with ``RunDashboard().follow(run)`` in the cell, so the frames go
to the page, which draws them: the live sketch (SVG, :mod:`labkit.widgets.sketch`) while the run goes, the full
picture (PNG) when it ends; ``bare again`` is a second bare run, the control: each round runs the three in one
of the six orders, in turn. The painter is started before the first round (as a notebook's first run leaves it;
the default dashboard does not use it). The page counts the frames it received: a MutationObserver notes the time
each new sketch or picture in the cell's output was drawn (the next animation frame) or loaded, and the benchmark
reads them back when the cell ends; per dashboard round it reports the live
frames (those loaded before the run's last step), the first frame's delay after the launch, and the gaps from the
first frame to the run's end (:func:`labkit.widgets.painter.frame_gaps`). Per run it also reads, as the kernel
counts them (``/proc``), the CPU the processes a frame passes through used while the run stepped (chromium's by
process type, the lab server's, the kernel's) and the whole machine's, in cores (:class:`CpuSampler`).
The summary: each round's ratio dashboard / bare, their median and IQR, a seeded bootstrap 95% interval of the
median (:func:`labkit.rounds.bootstrap_median_interval`), ``held_cost`` (at least 20 rounds and the interval's
lower bound >= 0.97) and ``held_frames`` (every dashboard round drew a live frame and no gap exceeded 3 s); and
the control's ratio bare again / bare by the same rules: ``resolvable`` says whether a dashboard that cost nothing
would have held on this machine (where it would not, a miss says as much of the machine's noise as of the
dashboard).

    .venv/bin/python benchmarks/dashboard_cost.py --browser [--rounds 24] [--steps 600]

Each run appends its table to ``benchmarks/results/dashboard_cost.jsonl`` (``dashboard_cost_browser`` for the
browser's).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import labkit
from labkit.cpu import process_cpu_seconds, process_tree
from labkit.metrics.events import final_trajectory
from labkit.metrics.window import warmup_skip
from labkit.results import write_results
from labkit.rounds import bootstrap_median_interval, ratio_summary
from labkit.widgets.dashboard import EVERY_S, RunDashboard
from labkit.widgets.painter import frame_gaps
from labkit.widgets.sketch import CLASS as SKETCH_CLASS

VARIANTS = ("bare", "dashboard")
NPROC = 2
ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.97  # the dashboard costs the run at most 3% of its throughput: the bootstrap interval's lower bound
MAX_FRAME_GAP_S = 3.0  # a live frame at least this often, as the browser received them
BROWSER_ROUNDS = 20  # the fewest rounds the target is judged on
DEFAULT_BROWSER_ROUNDS = 24  # --browser's default: four of each order of BROWSER_VARIANTS
BROWSER_VARIANTS = ("bare", "dashboard", "bare again")  # the control: how far two bare runs differ here (A/A)
BROWSER_ORDERS = tuple(itertools.permutations(BROWSER_VARIANTS))
RESAMPLES = 10_000
NOTEBOOK = "dashboard_cost.ipynb"
QUICK_MODEL = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
               "data.batch_size": 8, "data.micro_batch_size": 4}


def round_order(r: int) -> tuple[str, ...]:
    """A B, B A, A B, …: neither variant always goes first."""
    return VARIANTS if r % 2 == 0 else VARIANTS[::-1]


def browser_order(r: int) -> tuple[str, ...]:
    """--browser: the three runs of round ``r`` in one of the six orders, in turn: every variant in every place
    equally often over each six rounds, so a drift within a round favours none."""
    return BROWSER_ORDERS[r % len(BROWSER_ORDERS)]


def benchmark_config(steps: int, runs_dir: str, quick: bool):
    cfg = labkit.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml"))
    return cfg.replace(**{"run.steps": steps or cfg.run.steps, "run.runs_dir": runs_dir, "run.save_final": False,
                          "run.eval_every": 0 if quick else cfg.run.eval_every, **(QUICK_MODEL if quick else {})})


def overlap_ratio(events: list[dict], frames: list[tuple[float, float]]) -> float | None:
    """Median speed of the steady-state steps that overlapped a redraw over that of the others (None if either
    set is empty): below 1, drawing shows in the throughput curve.

    A step spans the time between its event and the previous one (``time`` is when rank 0 wrote it). Medians,
    so a few slow steps of another cause (an evaluation) do not decide it.
    """
    steps = final_trajectory(events)
    steps = steps[warmup_skip(len(steps)):]
    during, outside = [], []
    for before, step in zip(steps, steps[1:]):
        start, end = before["time"], step["time"]
        hit = any(a < end and b > start for a, b in frames)
        (during if hit else outside).append(end - start)
    if not during or not outside:
        return None
    return statistics.median(outside) / statistics.median(during)


def finished_summary(run, variant: str) -> dict:
    """The run's summary; a run that did not finish: an error naming its status and directory."""
    summary = run.summary or {}
    if summary.get("status") != "finished":
        raise RuntimeError(f"the {variant} run ended {summary.get('status')}: {summary.get('error')}; "
                           f"see {run.run_dir}")
    return summary


def one_run(cfg, variant: str, every_s: float) -> dict:
    load = os.getloadavg()[0]
    began = time.perf_counter()
    run = labkit.launch(cfg, nproc=NPROC)
    row = {"variant": variant, "load_1min_before": load}
    if variant == "dashboard":
        dashboard = RunDashboard()
        dashboard.follow_in_background(run, every_s)
        dashboard.join()
        stats = dashboard.drawing_stats()
        ended = max(e["time"] for e in run.events() if e.get("type") == "step")
        live = [(a, b) for a, b in stats["intervals"] if a < ended]  # frames begun while the run went
        row.update(frames=stats["frames"], live_frames=len(live), skipped=stats["skipped"],
                   live_draw_cpu_s=stats["cpu_s"] - stats["final_cpu_s"], last_frame_cpu_s=stats["final_cpu_s"],
                   draw_wall_s=stats["wall_s"], follow_cpu_s=stats["follow_cpu_s"],
                   overlap_speed=overlap_ratio(run.events(), live))
    else:
        run.wait()
    summary = finished_summary(run, variant)
    return {**row, "tokens_per_s": summary["tokens_per_s"], "wall_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help=f"default 4, {DEFAULT_BROWSER_ROUNDS} with --browser")
    parser.add_argument("--steps", type=int, help="default 300; with --browser, notebook 00's (the config's)")
    parser.add_argument("--every", type=float, default=EVERY_S, help="the dashboard's redraw period (s)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round of 30 steps (for the tests)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="--browser: bare runs before the rounds, recorded apart (the lab's and the browser's "
                             "start-up, the caches), none compared")
    parser.add_argument("--browser", action="store_true",
                        help="launch the runs from a notebook in JupyterLab in chromium, the page counting the frames")
    args = parser.parse_args()
    args.rounds = args.rounds or (DEFAULT_BROWSER_ROUNDS if args.browser else 4)
    args.steps = args.steps or (benchmark_config(None, "", False).run.steps if args.browser else 300)
    if args.browser:
        if args.rounds < 1 or args.steps < 20:
            parser.error("--rounds must be >= 1 and --steps >= 20")
        return browser_main(args)
    if args.quick:
        args.rounds, args.steps, args.every = 1, 30, 0.5
    if args.rounds < 1 or args.steps < 20:
        parser.error("--rounds must be >= 1 and --steps >= 20")
    rows, rounds = [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        cfg = benchmark_config(args.steps, runs_dir, args.quick)
        print(f"{NPROC} processes, {cfg.model.n_layer} layers × {cfg.model.n_embd} wide, {args.steps} steps per run, "
              f"redraw every {args.every:g} s; {args.rounds} interleaved round(s)")
        for r in range(args.rounds):
            got = {v: one_run(cfg, v, args.every) for v in round_order(r)}
            for v in round_order(r):
                rows.append({"round": r + 1, **got[v]})
                d = got[v]
                extra = (f"  {d['live_frames']} live frame(s) ({d['skipped']} redraws skipped) drawn in "
                         f"{d['live_draw_cpu_s']:.2f} CPU s at nice 19, follow loop {d['follow_cpu_s']:.2f} CPU s; "
                         f"steps beside a redraw {_fmt(d['overlap_speed'])}× the others' speed"
                         if v == "dashboard" else "")
                print(f"round {r + 1} {v:9s} {got[v]['tokens_per_s']:9,.0f} tokens/s  "
                      f"load {got[v]['load_1min_before']:.2f}" + extra)
            rounds.append(got["dashboard"]["tokens_per_s"] / got["bare"]["tokens_per_s"])
    print(f"throughput ratio dashboard/bare: median {statistics.median(rounds):.3f} "
          f"(min {min(rounds):.3f}, max {max(rounds):.3f}); target >= 0.97")
    settings = {**vars(args), "nproc": NPROC, "config": "configs/quickstart.yaml",
                "model": {k: v for k, v in cfg.to_dict()["model"].items() if k in ("n_layer", "n_embd", "block_size")},
                "ratio_median": statistics.median(rounds), "ratios": rounds}
    print(f"results: appended to {write_results('dashboard_cost', rows, settings, table='dashboard_cost')}")


# ---------------------------------------------------------------- --browser: the runs launched from a notebook

FRAME_COUNTER = r"""() => {
    window.__frames = [];
    window.__lastSrc = null;
    if (window.__frameObserver) window.__frameObserver.disconnect();
    const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
    const note = img => {
        const src = img.getAttribute('src') || '';
        if (!/^data:image\/(png|svg\+xml)/.test(src) || src === window.__lastSrc) return;
        window.__lastSrc = src;
        const received = Date.now();
        const kind = src.startsWith('data:image/png') ? 'png' : 'svg';
        const loaded = () => window.__frames.push({received, loaded: Date.now(), chars: src.length, kind});
        if (img.complete && img.naturalWidth) loaded(); else img.addEventListener('load', loaded, {once: true});
    };
    const sketch = svg => {  // the live sketch: SVG in the page, drawn on the next animation frame
        const received = Date.now();
        requestAnimationFrame(() => window.__frames.push({received, loaded: Date.now(),
                                                          chars: svg.outerHTML.length, kind: 'svg'}));
    };
    const added = node => {
        if (node.tagName === 'IMG') note(node);
        else if (node.classList && node.classList.contains('SKETCH_CLASS')) sketch(node);
        else if (node.querySelectorAll) {
            node.querySelectorAll('img').forEach(note);
            node.querySelectorAll('svg.SKETCH_CLASS').forEach(sketch);
        }
    };
    window.__frameObserver = new MutationObserver(changes => {
        for (const change of changes) {
            if (change.type === 'attributes' && change.target.tagName === 'IMG') note(change.target);
            for (const node of change.addedNodes || []) added(node);
        }
    });
    window.__frameObserver.observe(nb, {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""

FRAME_COUNTER = FRAME_COUNTER.replace("SKETCH_CLASS", SKETCH_CLASS)

RUN_CELL = """code => {
    const panel = window.jupyterapp.shell.currentWidget;
    panel.content.activeCellIndex = 0;
    panel.content.widgets[0].model.sharedModel.setSource(code);
    window.jupyterapp.commands.execute('notebook:run-cell');
}"""

CELL_ERROR = """() => [...document.querySelectorAll('.jp-Notebook [data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).filter(t => t.includes('Traceback')).join('\\n').slice(0, 2000)"""

KERNEL_IDLE = "() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'"


def notebook_json() -> str:
    """A notebook of one empty code cell (nbformat 4.5): the benchmark writes each run's code into it."""
    cell = {"cell_type": "code", "id": "dashboard-cost", "metadata": {}, "execution_count": None, "outputs": [],
            "source": ""}
    nb = {"nbformat": 4, "nbformat_minor": 5, "cells": [cell], "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def kernel_run(variant: str, steps: int, runs_dir: str, quick: bool, every_s: float, out: str) -> None:
    """In the notebook's kernel: one run, followed by a dashboard in this cell or not; its row written to ``out``."""
    cfg = benchmark_config(steps, runs_dir, quick)
    load, began, launched = os.getloadavg()[0], time.perf_counter(), time.time()
    run = labkit.launch(cfg, nproc=NPROC)
    row = {"variant": variant, "load_1min_before": load, "launched": launched}
    if variant == "dashboard":
        dashboard = RunDashboard()
        dashboard.follow(run, every_s)  # display handles in this cell's output: the page draws each frame
        stats = dashboard.drawing_stats()
        row.update(painter_frames=stats["frames"], live_draw_cpu_s=stats["cpu_s"] - stats["final_cpu_s"],
                   follow_cpu_s=stats["follow_cpu_s"], painter_errors=stats["errors"], painter_nice=stats["boosts"])
    else:
        run.wait()
    summary = finished_summary(run, variant)
    step_times = [e["time"] for e in run.events() if e.get("type") == "step"]
    row.update(tokens_per_s=summary["tokens_per_s"], wall_s=time.perf_counter() - began,
               first_step=min(step_times), run_end=max(step_times))
    Path(out).write_text(json.dumps(row))


def kernel_code(variant: str, args, runs_dir: str, out: Path) -> str:
    return (f"import sys\nsys.path.insert(0, {str(ROOT / 'benchmarks')!r})\nimport dashboard_cost\n"
            f"dashboard_cost.kernel_run({variant!r}, {args.steps}, {runs_dir!r}, {args.quick}, {args.every}, "
            f"{str(out)!r})")


WARM_PAINTER = ("import sys\nsys.path.insert(0, {bench!r})\nimport dashboard_cost\n"
                "from labkit.widgets.painter import painter\nprint(painter().describe())")


def run_cell(page, code: str, done: Path, timeout_s: float) -> None:
    """Write ``code`` into the notebook's cell and run it; wait until it wrote ``done`` and the kernel is idle (a
    traceback in the cell: its text, raised)."""
    page.evaluate(RUN_CELL, code)
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        error = page.evaluate(CELL_ERROR)
        if error:
            raise RuntimeError(f"the notebook's cell failed:\n{error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the notebook's cell did not finish within {timeout_s:.0f} s")
        time.sleep(0.5)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000, polling=200)


def frames_row(row: dict, frames: list[dict]) -> dict:
    """What the page received while the run went: live frames, the first one's delay, the gaps, held or not."""
    end_ms = row["run_end"] * 1000
    loaded = [f["loaded"] for f in frames]
    gaps = [g / 1000 for g in frame_gaps(loaded, end_ms)]
    live = [t for t in loaded if t <= end_ms]
    return {"frames_received": len(frames), "live_frames": len(live),
            "first_frame_after_launch_s": (live[0] / 1000 - row["launched"]) if live else None,
            "max_gap_s": max(gaps) if gaps else None, "gaps_s": gaps,
            "frame_times_s": [t / 1000 - row["launched"] for t in loaded],
            "frame_chars": [f["chars"] for f in frames],
            "frames_held": bool(gaps) and max(gaps) <= MAX_FRAME_GAP_S}


def machine_busy_s(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds all cores of this machine have been busy since boot (``/proc/stat``'s first line: every state
    but idle and iowait)."""
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_groups(server_pid: int) -> dict[str, list[int]]:
    """The processes a frame passes through: the browser's (chromium's, below this process), the lab server and the
    notebook kernel (not its runs' workers)."""
    groups: dict[str, list[int]] = {"server": [], "kernel": []}
    for pid, cmd in process_tree(os.getpid()).items():
        if "chrom" in cmd.split(" ")[0]:  # chromium's processes by their --type (renderer, gpu-process, …)
            kind = next((a.split("=", 1)[1] for a in cmd.split(" ") if a.startswith("--type=")), "main")
            groups.setdefault(f"browser {kind}", []).append(pid)
    for pid, cmd in process_tree(server_pid).items():
        group = "server" if pid == server_pid else "kernel" if "ipykernel" in cmd else None
        if group:
            groups[group].append(pid)
    return groups


class CpuSampler:
    """Every ``interval`` seconds in a thread, the CPU seconds (as the kernel counts them) of each group's processes
    (:func:`cpu_groups`, resolved once at the start: reading a few ``stat`` files a second costs next to nothing)
    and of the whole machine (:func:`machine_busy_s`)."""

    def __init__(self, groups: dict[str, list[int]], interval: float = 0.5):
        self.groups, self.interval, self.samples = groups, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        reading = {g: sum(process_cpu_seconds(pid) or 0.0 for pid in pids) for g, pids in self.groups.items()}
        self.samples.append((time.time(), {**reading, "machine": machine_busy_s()}))

    def _loop(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cores_used(self, start: float, end: float) -> dict[str, float] | None:
        """Each group's CPU seconds per second of wall clock between the first sample at or after ``start`` and the
        last at or before ``end`` (None if fewer than two samples fall there)."""
        inside = [(t, r) for t, r in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        (t0, r0), (t1, r1) = inside[0], inside[-1]
        return {g: (r1[g] - r0[g]) / (t1 - t0) for g in r1}


def browser_rounds(page, args, workdir: Path, server_pid: int) -> list[dict]:
    """The interleaved rounds, each run launched from the notebook's kernel; every row, in order."""
    rows = []
    runs_dir = str(workdir / "runs")
    for r in range(args.rounds):
        for variant in browser_order(r):
            out = workdir / f"round{r + 1}_{variant.replace(' ', '_')}.json"
            page.evaluate(FRAME_COUNTER)
            with CpuSampler(cpu_groups(server_pid)) as sampler:
                run_cell(page, kernel_code(variant, args, runs_dir, out), out, timeout_s=600)
            row = {"round": r + 1, **json.loads(out.read_text())}
            row["cores_used"] = sampler.cores_used(row["first_step"], row["run_end"])  # while the run stepped
            if variant == "dashboard":
                row.update(frames_row(row, page.evaluate("() => window.__frames")))
            rows.append(row)
            print(_browser_line(row), flush=True)
    return rows


def _browser_line(row: dict) -> str:
    extra = (f"  {row['live_frames']} live frame(s), first after {_fmt(row['first_frame_after_launch_s'])} s, "
             f"largest gap {_fmt(row['max_gap_s'])} s" if row["variant"] == "dashboard" else "")
    return (f"round {row['round']} {row['variant']:9s} {row['tokens_per_s']:9,.0f} tokens/s  "
            f"load {row['load_1min_before']:.2f}  wall {row['wall_s']:.1f} s" + extra
            + _cores_text(row.get("cores_used")))


def _cores_text(cores: dict | None) -> str:
    return "" if not cores else "  cores used: " + ", ".join(f"{g} {c:.3f}" for g, c in cores.items())


def browser_summary(rows: list[dict]) -> dict:
    """Each round's ratio dashboard / bare (paired within the round), its median, IQR and bootstrap interval, and
    whether the two targets held; beside it the control, bare again / bare, by the same rules (where the rounds
    have it): ``resolvable`` says whether a dashboard that cost nothing would have held here, i.e. whether this
    machine's run-to-run noise lets the protocol tell a 3% cost from none."""
    by_round: dict[int, dict] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["variant"]] = row
    ratios = [r["dashboard"]["tokens_per_s"] / r["bare"]["tokens_per_s"] for r in by_round.values()]
    low, high = bootstrap_median_interval(ratios, resamples=RESAMPLES, seed=0)
    dash = [r["dashboard"] for r in by_round.values()]
    gaps = [r["max_gap_s"] for r in dash if r["max_gap_s"] is not None]
    summary = {"ratio": ratio_summary(ratios, lower_is_faster=False), "ratio_median": statistics.median(ratios),
               "ratio_ci95": [low, high], "bootstrap": {"resamples": RESAMPLES, "seed": 0, "of": "median"},
               "held_cost": len(ratios) >= BROWSER_ROUNDS and low >= TARGET_RATIO,
               "max_gap_s": max(gaps, default=None), "min_live_frames": min(r["live_frames"] for r in dash),
               "held_frames": all(r["frames_held"] for r in dash),
               "targets": {"ratio_ci95_low_at_least": TARGET_RATIO, "rounds_at_least": BROWSER_ROUNDS,
                           "max_gap_s_at_most": MAX_FRAME_GAP_S}}
    controls = [r["bare again"]["tokens_per_s"] / r["bare"]["tokens_per_s"] for r in by_round.values()
                if "bare again" in r]
    if controls:
        c_low, c_high = bootstrap_median_interval(controls, resamples=RESAMPLES, seed=0)
        summary["control"] = {"of": "bare again / bare", "ratio": ratio_summary(controls, lower_is_faster=False),
                              "ratio_median": statistics.median(controls), "ratio_ci95": [c_low, c_high],
                              "resolvable": len(controls) >= BROWSER_ROUNDS and c_low >= TARGET_RATIO}
    return summary


def browser_main(args) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "browser"))
    from browser_lab import Browser, open_notebook, start_lab

    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        lab = start_lab(workdir, quick=False, extra_env={"PYTHONPATH": str(ROOT)})  # the kernel: this labkit
        browser = None
        try:
            (lab.root / NOTEBOOK).write_text(notebook_json(), encoding="utf-8")
            browser = Browser()
            open_notebook(browser.page, lab, NOTEBOOK)
            warmed = workdir / "warm.json"
            run_cell(browser.page, WARM_PAINTER.format(bench=str(ROOT / "benchmarks"))
                     + f"\nopen({str(warmed)!r}, 'w').write('1')", warmed, timeout_s=300)
            cfg = benchmark_config(args.steps, str(workdir / "runs"), args.quick)
            print(f"{NPROC} processes launched from a notebook in chromium, {cfg.model.n_layer} layers × "
                  f"{cfg.model.n_embd} wide, {args.steps} steps per run; {args.rounds} interleaved round(s)")
            warmups = []
            for w in range(args.warmup):
                out = workdir / f"warmup{w + 1}.json"
                run_cell(browser.page, kernel_code("bare", args, str(workdir / "runs"), out), out, timeout_s=600)
                warmups.append(json.loads(out.read_text()))
                print(f"warm-up {w + 1}: {warmups[-1]['tokens_per_s']:,.0f} tokens/s (not compared)", flush=True)
            rows = browser_rounds(browser.page, args, workdir, lab.process.pid)
        finally:
            if browser is not None:
                browser.close()
            lab.stop()
    summary = browser_summary(rows)
    print(f"throughput ratio dashboard/bare: median {summary['ratio_median']:.3f}, IQR "
          f"{summary['ratio']['q1']:.3f}–{summary['ratio']['q3']:.3f}, bootstrap 95% interval "
          f"{summary['ratio_ci95'][0]:.3f}–{summary['ratio_ci95'][1]:.3f} over {summary['ratio']['n_rounds']} "
          f"round(s): "
          f"held {summary['held_cost']} (target: lower bound >= {TARGET_RATIO}, >= {BROWSER_ROUNDS} rounds)")
    control = summary.get("control")
    if control:
        print(f"control, bare again / bare: median {control['ratio_median']:.3f}, bootstrap 95% interval "
              f"{control['ratio_ci95'][0]:.3f}–{control['ratio_ci95'][1]:.3f}: a dashboard that cost nothing would "
              f"{'' if control['resolvable'] else 'not '}have held on this machine")
    print(f"frames: largest gap {_fmt(summary['max_gap_s'])} s, fewest live frames {summary['min_live_frames']}: "
          f"held {summary['held_frames']} (target: every gap <= {MAX_FRAME_GAP_S:g} s)")
    settings = {**vars(args), "nproc": NPROC, "config": "configs/quickstart.yaml", "browser": "chromium (Debian)",
                "painter": "started before round 1", "warmup_runs": warmups, "model": {
                    k: v for k, v in cfg.to_dict()["model"].items() if k in ("n_layer", "n_embd", "block_size")},
                **summary}
    print(f"results: appended to {write_results('dashboard_cost', rows, settings, table='dashboard_cost_browser')}")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
