"""How much memory and CPU does one seat of ``make hub`` take during a lab, and what would a room need?

For each seat count (1, 2, 3 by default) this starts the hub (``labkit.hub.start_hub``, the config ``make hub``
uses) on a free port, logs that many participants in with Playwright and Debian's chromium (each in a browser
context of its own, as ``tests/browser/test_hub.py`` does), opens a notebook on every seat and presses Run All on
all of them at once. While the lab runs, every ``--interval`` seconds it reads ``/proc`` for every process of the
hub (found by ``LABKIT_HUB_DIR`` in its environment, so each process is counted for its seat: its server, kernels,
launcher, workers and the dashboard's painter):

- memory: the sum over a seat's processes of PSS (``/proc/PID/smaps_rollup``: shared pages, e.g. torch's
  libraries, split among the processes sharing them, so sums over processes add up) and of RSS (each process's
  resident pages in full: overstates a sum), their peaks over the lab and their values with the notebook open and
  idle before it; the hub's own (JupyterHub and its proxy) apart;
- CPU: the CPU seconds (``utime + stime`` in ``/proc/PID/stat``) the seat's processes used from the first press to
  the seat's last cell, and those over the seat's wall seconds (the cores it kept busy on average). A process that
  ends between two reads loses at most one interval's CPU time.

From the largest seat count measured it writes a second table, labelled an estimate, for 20 and 50 seats:
memory = the hub's own + seats × the largest per-seat PSS peak; cores to keep every seat at the one-seat pace =
seats × (per-seat CPU seconds ÷ the one-seat wall seconds). It is linear by construction: what it leaves out
(memory bandwidth, the scheduler at high core counts) is said in its ``basis`` field.

Measure on a quiet machine (1-minute load well under the cores; each row records the load before it): on a
shared one the CPU seconds hold, the wall seconds do not.

    .venv/bin/python benchmarks/hub_sizing.py [--seats 1 2 3] [--notebook 00] [--mode quick|full]
                                             [--cpus-per-seat 1] [--interval 1]

Needs ``make hub``'s installs (jupyterhub, the proxy under ``.hub/``) and ``make browser``. Appends its tables to
``benchmarks/results/hub_sizing.jsonl``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "browser"))

from browser_lab import NOTEBOOKS, Browser, close_notebook, page_problems  # noqa: E402
from hub_seats import log_in, run_all_at_once  # noqa: E402

from labkit.cpu import process_cpu_seconds  # noqa: E402
from labkit.hub import available_cores, hub_processes, start_hub  # noqa: E402
from labkit.launcher import free_port  # noqa: E402
from labkit.results import write_results  # noqa: E402

USERS = tuple(f"seat{i:02d}" for i in range(1, 100))
PASSWORD = "hub-sizing-password"
ESTIMATED_SEATS = (20, 50)
def memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB; (0, 0) once it is gone."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


class Sampler:
    """Reads the hub's processes every ``interval`` seconds in a thread: per seat (None: the hub itself) the peak
    PSS and RSS sums and the CPU seconds used since :meth:`start`."""

    def __init__(self, state_dir: Path, interval: float):
        self.state_dir, self.interval = state_dir, interval
        self.peak: dict = {}
        self.cpu: dict = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def snapshot(self, processes: dict | None = None) -> dict:
        """Per seat: the PSS and RSS sums now, in MiB."""
        sums: dict = {}
        for pid, seat in (hub_processes(self.state_dir) if processes is None else processes).items():
            pss, rss = memory_kib(pid)
            total = sums.setdefault(seat, [0, 0])
            total[0] += pss / 1024
            total[1] += rss / 1024
        return sums

    def start(self) -> "Sampler":
        self._last = {pid: process_cpu_seconds(pid) or 0.0 for pid in hub_processes(self.state_dir)}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.interval)
        self._read()

    def _read(self) -> None:
        processes = hub_processes(self.state_dir)
        for seat, (pss, rss) in self.snapshot(processes).items():
            old = self.peak.get(seat, (0.0, 0.0))
            self.peak[seat] = (max(old[0], pss), max(old[1], rss))
        for pid, seat in processes.items():
            now = process_cpu_seconds(pid)
            if now is not None:
                self.cpu[seat] = self.cpu.get(seat, 0.0) + now - self._last.get(pid, 0.0)
                self._last[pid] = now


def notebook_named(prefix: str) -> str:
    names = [nb.name for nb in NOTEBOOKS if nb.name.startswith(prefix)]
    if len(names) != 1:
        raise SystemExit(f"--notebook {prefix!r} names {len(names)} notebooks; there are: "
                         f"{', '.join(nb.name for nb in NOTEBOOKS)}")
    return names[0]


def measure(seats: int, notebook: str, quick: bool, cpus_per_seat: int, interval: float) -> dict:
    """One hub with ``seats`` participants running ``notebook`` at once: the row of the sizing table."""
    users = USERS[:seats]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir:
        hub = start_hub(Path(workdir) / "hub", free_port(), users, PASSWORD, cpus_per_seat=cpus_per_seat,
                        quick=quick)
        browser = Browser()
        try:
            logged_in = [log_in(browser.browser, hub, user, PASSWORD) for user in users]
            time.sleep(5)  # the servers settle after their start
            sampler = Sampler(hub.state_dir, interval)
            idle = sampler.snapshot()
            sampler.start()
            took = run_all_at_once(logged_in, notebook, timeout_s=3600)
            sampler.stop()
            problems = {seat.user: page_problems(seat.page) for seat in logged_in}
            for seat in logged_in:
                close_notebook(seat.page)
        finally:
            browser.close()
            left = hub.stop()
    per_seat = [{"seat": u, "seconds": round(took[u], 1), "cpu_s": round(sampler.cpu.get(u, 0.0), 1),
                 "cores_busy": round(sampler.cpu.get(u, 0.0) / took[u], 2),
                 "idle_pss_mib": round(idle.get(u, [0, 0])[0]), "peak_pss_mib": round(sampler.peak[u][0]),
                 "peak_rss_sum_mib": round(sampler.peak[u][1]), "problems": problems[u]} for u in users]
    return {"seats": seats, "load_1min_before": round(load_before, 2), "per_seat": per_seat,
            "hub_pss_mib": round(sampler.peak.get(None, (0, 0))[0]),
            "peak_pss_mib_per_seat": max(s["peak_pss_mib"] for s in per_seat),
            "cpu_s_per_seat": round(statistics.mean(s["cpu_s"] for s in per_seat), 1),
            "seconds_per_lab": round(max(took.values()), 1), "processes_killed_at_stop": left}


def estimate(rows: list[dict]) -> list[dict]:
    """20 and 50 seats, from the largest seat count measured and the one-seat pace: labelled an estimate."""
    basis_row = max(rows, key=lambda r: r["seats"])
    one = next((r for r in rows if r["seats"] == 1), None)
    pace = one["seconds_per_lab"] if one else None
    basis = (f"estimate, linear in seats from the {basis_row['seats']}-seat measurement: memory = hub + seats × peak "
             "PSS per seat; cores = seats × CPU seconds per seat ÷ the 1-seat lab's seconds (every seat at the "
             "1-seat pace). Leaves out memory bandwidth, caches and the scheduler at high core counts.")
    return [{"seats": n, "estimate": True, "basis": basis,
             "memory_gib": round((basis_row["hub_pss_mib"] + n * basis_row["peak_pss_mib_per_seat"]) / 1024, 1),
             "cores_at_one_seat_pace": round(n * basis_row["cpu_s_per_seat"] / pace, 1) if pace else None}
            for n in ESTIMATED_SEATS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seats", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--notebook", default="00", help="the lab every seat runs (a name prefix)")
    parser.add_argument("--mode", choices=("quick", "full"), default="quick")
    parser.add_argument("--cpus-per-seat", type=int, default=1)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two reads of /proc")
    args = parser.parse_args()
    notebook = notebook_named(args.notebook)
    if any(n < 1 or n > len(USERS) for n in args.seats):
        raise SystemExit(f"--seats: each between 1 and {len(USERS)}")
    if args.cpus_per_seat > len(available_cores()):
        raise SystemExit(f"--cpus-per-seat {args.cpus_per_seat}: this machine has {len(available_cores())} cores")
    rows = []
    for seats in sorted(args.seats):
        rows.append(measure(seats, notebook, args.mode == "quick", args.cpus_per_seat, args.interval))
        print({k: v for k, v in rows[-1].items() if k != "per_seat"})
    settings = {"notebook": notebook, "mode": args.mode, "cpus_per_seat": args.cpus_per_seat,
                "interval_s": args.interval, "cores": len(available_cores())}
    print(f"results: appended to {write_results('hub_sizing', rows, settings, table='hub_sizing')}")
    write_results("hub_sizing", estimate(rows), settings, table="hub_sizing_estimate",
                  notes="an estimate, not a measurement: see each row's basis")
    for row in estimate(rows):
        print(row)


if __name__ == "__main__":
    main()
