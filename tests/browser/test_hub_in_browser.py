"""``make hub`` serving a room: three participants log in at once, each in a browser context of its own, and each
runs notebook 00 in quick mode at the same time.

Each sees its own dashboard (a picture drawn, the status line of an ended run) and its own run directory, which
lies in its own home and in no other; the three runs' rendezvous ports differ, and each run store holds that
seat's run alone. Each seat's server runs on the cores the hub gave it. Once the hub is stopped, none of its
processes (proxy, servers, kernels, workers) is left. The run's seconds are printed, not asserted.
"""
import json
import os
import sqlite3
import time

import pytest
from browser_lab import close_notebook, page_problems, screenshot
from hub_seats import RUN_CELL, cell_shows, log_in, printed_run_dir, run_all_at_once

from labkit.hub import available_cores, hub_processes, seat_cores, seat_home, start_hub
from labkit.launcher import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.notebook, pytest.mark.browser]

USERS = ("ana", "ben", "chen")
PASSWORD = "a-room-password"
NOTEBOOK = "00_quickstart.ipynb"


@pytest.fixture
def hub(tmp_path):
    started = start_hub(tmp_path / "hub", free_port(), USERS, PASSWORD, cpus_per_seat=1, memory="4G", quick=True)
    yield started
    started.stop()


def test_three_seats_run_notebook_00_at_once_each_on_its_own(hub, browser):
    """``browser`` is the session's Chromium (tests/browser/conftest.py): Playwright's sync API runs one per
    process, so a second ``Browser()`` here fails once another browser test has started it."""
    start = time.monotonic()
    seats = [log_in(browser.browser, hub, user, PASSWORD) for user in USERS]
    try:
        took = run_all_at_once(seats, NOTEBOOK)
        print(f"three seats, notebook 00 quick, Run All at once: {took} s after the first press")
        shown = {}
        for seat in seats:
            screenshot(seat.page, f"hub-{seat.user}")
            shown[seat.user] = (page_problems(seat.page), cell_shows(seat, RUN_CELL), printed_run_dir(seat))
            close_notebook(seat.page)
        checked_servers = servers_cores(hub)
    finally:
        for seat in seats:
            seat.close()
    for user, (problems, dashboard, _) in shown.items():
        assert not problems, f"{user}: " + "\n".join(problems)
        assert dashboard["images"] >= 1 and "finished" in dashboard["text"], f"{user}'s dashboard: {dashboard}"
    run_dirs = {user: seat_home(hub.state_dir, user) / "notebooks" / printed for user, (_, _, printed) in shown.items()}
    assert_runs_apart(hub, run_dirs)
    assert checked_servers == {user: seat_cores(i, 1, available_cores()) for i, user in enumerate(USERS)}
    assert hub.stop() == [], "processes outlived the hub's SIGTERM and had to be killed"
    assert hub_processes(hub.state_dir) == {}
    print(f"the whole test: {time.monotonic() - start:.0f} s")


def assert_runs_apart(hub, run_dirs: dict) -> None:
    """Each printed run directory is that seat's, finished, under its own home; ports and stores not shared."""
    endpoints = {}
    for user, run_dir in run_dirs.items():
        assert (run_dir / "summary.json").exists(), f"{user}: no finished run at {run_dir}"
        others = [other for other in USERS if other != user]
        assert not any((seat_home(hub.state_dir, o) / "notebooks" / "runs" / run_dir.name).exists() for o in others)
        endpoints[user] = json.loads((run_dir / "launch.json").read_text())["rendezvous"]
        store = seat_home(hub.state_dir, user) / "notebooks" / "runs" / "labkit-runs.sqlite"
        with sqlite3.connect(store) as db:
            names = [row[0] for row in db.execute("SELECT run_dir FROM runs")]
        assert [n.rstrip("/").rsplit("/", 1)[-1] for n in names] == [run_dir.name], f"{user}'s store: {names}"
    assert len(set(endpoints.values())) == len(USERS), f"rendezvous endpoints shared: {endpoints}"


def servers_cores(hub) -> dict:
    """Each seat's processes: the cores they may run on (all of a seat's alike), by seat."""
    cores: dict = {}
    for pid, seat in hub_processes(hub.state_dir).items():
        if seat is not None:
            try:
                cores.setdefault(seat, set()).add(tuple(sorted(os.sched_getaffinity(pid))))
            except OSError:
                continue
    assert all(len(sets) == 1 for sets in cores.values()), f"a seat's processes on different cores: {cores}"
    return {seat: list(next(iter(sets))) for seat, sets in cores.items()}
