"""How long does each notebook's Run All take in a real browser, in quick mode and in full?

The browser tests (``tests/browser``) run every notebook in quick mode and assert what the page shows, never
how long it took. This benchmark times the same thing — JupyterLab in Debian's chromium at 1,400 px, the
notebook opened alone, JupyterLab's own Run All, until every code cell has run — in quick mode
(``LABKIT_QUICK=1``: what the tests and a short demo run) and in full mode (what a workshop room runs), and
records each notebook's seconds and what the page showed wrong, if anything.

    .venv/bin/python benchmarks/browser_times.py [--modes quick full] [--notebooks 00 07] [--timeout 1800]

Each run appends its table to ``benchmarks/results/browser_times.jsonl``. Full mode takes long on a laptop:
name the notebooks to time a few.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "browser"))

from browser_lab import NOTEBOOKS, Browser, close_notebook, page_problems, run_all, start_lab  # noqa: E402

from labkit.results import write_results  # noqa: E402


def chosen(prefixes: list[str] | None) -> list[str]:
    """The notebooks whose names start with one of ``prefixes`` (all of them without any); an unknown prefix is
    an error, before anything starts."""
    names = [nb.name for nb in NOTEBOOKS]
    if not prefixes:
        return names
    unknown = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if unknown:
        raise SystemExit(f"no notebook starts with {', '.join(unknown)}; there are: {', '.join(names)}")
    return [n for n in names if any(n.startswith(p) for p in prefixes)]


def time_mode(mode: str, notebooks: list[str], timeout_s: float, deadline: float) -> list[dict]:
    """Each notebook's Run All in ``mode``; past ``deadline`` (monotonic) the rest are listed as not timed."""
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        lab, browser = start_lab(Path(workdir), quick=mode == "quick"), None
        try:
            browser = Browser()
            for name in notebooks:
                row = {"mode": mode, "notebook": name}
                if time.monotonic() > deadline:
                    rows.append({**row, "seconds": None, "problems": ["not timed: the --budget was spent"]})
                    continue
                try:
                    row["seconds"] = run_all(browser.page, lab, name, timeout_s)
                    row["problems"] = page_problems(browser.page)
                except Exception as error:  # noqa: BLE001 — recorded, and the next notebook is timed
                    row.update(seconds=None, problems=[f"{type(error).__name__}: {str(error)[:300]}"])
                finally:
                    try:
                        close_notebook(browser.page)
                    except Exception:  # noqa: BLE001 — a page that broke: the next notebook opens a fresh tab
                        pass
                seconds = "failed" if row["seconds"] is None else f"{row['seconds']:7.1f} s"
                print(f"{mode:5s} {name:28s} {seconds}  {'; '.join(row['problems'])[:160]}", flush=True)
                rows.append(row)
        finally:
            if browser is not None:
                browser.close()
            lab.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=("quick", "full"), default=["quick", "full"])
    parser.add_argument("--notebooks", nargs="*", help="name prefixes, e.g. 00 07 (default: every notebook)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one notebook's Run All may take")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds in all: no notebook starts after them (those left are recorded as not timed)")
    args = parser.parse_args()
    notebooks = chosen(args.notebooks)
    deadline = time.monotonic() + args.budget
    settings = {**vars(args), "cpus": os.cpu_count(), "viewport": "1400x900, file browser open"}
    for mode in args.modes:  # one table per mode, written as soon as it is done
        rows = time_mode(mode, notebooks, args.timeout, deadline)
        times = [r["seconds"] for r in rows if r["seconds"] is not None]
        print(f"{mode}: {len(times)} of {len(rows)} notebooks ran; {sum(times):.0f} s in all, the longest "
              f"{max(times, default=0):.1f} s")
        path = write_results("browser_times", rows, {**settings, "mode": mode}, table="browser_times")
        print(f"results: appended to {path}")


if __name__ == "__main__":
    main()
