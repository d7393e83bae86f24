"""The room's side of ``make hub`` in a real browser: participants log in, each in a Playwright context of its own
(its own cookies: its own session), and run a notebook at the same time.

A :class:`Seat` is one participant's logged-in page; its :meth:`Seat.url` makes ``browser_lab``'s helpers
(``open_notebook``, ``page_problems``, ``close_notebook``) drive that participant's JupyterLab under
``/user/NAME/``. Used by ``test_hub.py`` and ``benchmarks/hub_sizing.py``.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from browser_lab import FINISHED, VIEWPORT, open_notebook

from labkit.hub import Hub

RUN_CELL = 1  # notebook 00's code cell that launches the run and follows it on the dashboard

SHOWN = """index => {
    // what one code cell of the open notebook shows, from the notebook's model (what the kernel sent this page):
    // the HTML of its outputs (the dashboard's status line) and how many pictures
    const model = window.jupyterapp.shell.currentWidget.content.model, code = [];
    for (let i = 0; i < model.cells.length; i++)
        if (model.cells.get(i).type === 'code') code.push(model.cells.get(i));
    let html = '', images = 0;
    for (let j = 0; j < code[index].outputs.length; j++) {
        const data = code[index].outputs.get(j).toJSON().data || {};
        const part = data['text/html'];
        if (part) html += Array.isArray(part) ? part.join('') : part;
        if (data['image/png']) images += 1;
    }
    return {text: html, images};
}"""

NOTEBOOK_TEXT = """() => {
    // the printed (stream) output of every code cell, read from the notebook's model: a cell scrolled out of view
    // may not be rendered at all
    const model = window.jupyterapp.shell.currentWidget.content.model, texts = [];
    for (let i = 0; i < model.cells.length; i++) {
        const cell = model.cells.get(i);
        if (cell.type !== 'code') continue;
        for (let j = 0; j < cell.outputs.length; j++) {
            const text = cell.outputs.get(j).toJSON().text;
            if (text) texts.push(Array.isArray(text) ? text.join('') : text);
        }
    }
    return texts.join('\\n');
}"""


@dataclass
class Seat:
    """One participant logged in to the hub in a browser context of its own."""
    hub: Hub
    user: str
    context: object
    page: object

    def url(self, path: str = "lab") -> str:
        return self.hub.url(f"user/{self.user}/{path}")

    def close(self) -> None:
        self.context.close()


def log_in(browser, hub: Hub, user: str, password: str, timeout_s: float = 180) -> Seat:
    """A new context (no cookie shared with another seat), the hub's login form filled in, and the wait until the
    participant's JupyterLab is up (the hub starts the server on login)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(hub.url("hub/login"))
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password)
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url(re.compile(rf"/user/{re.escape(user)}/lab"), timeout=timeout_s * 1000)
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=timeout_s * 1000)
    return Seat(hub, user, context, page)


def run_all_at_once(seats: list[Seat], notebook: str, timeout_s: float = 900) -> dict[str, float]:
    """Open ``notebook`` on every seat, then press Run All on each, one right after the other, so their runs
    overlap; wait for each to finish, in turn. The seconds from the first press until each seat was seen finished
    (a seat that finished while an earlier one was waited for is seen when that wait ends)."""
    for seat in seats:
        open_notebook(seat.page, seat, notebook)
    start = time.monotonic()
    for seat in seats:
        seat.page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    took = {}
    for seat in seats:
        seat.page.wait_for_function(FINISHED, timeout=timeout_s * 1000, polling=1000)
        took[seat.user] = time.monotonic() - start
    return took


def cell_shows(seat: Seat, index: int) -> dict:
    """Code cell ``index``'s HTML output and the number of pictures in it."""
    return seat.page.evaluate(SHOWN, index)


def printed_run_dir(seat: Seat) -> str:
    """The run directory notebook 00 prints ("run directory      runs/quickstart-…"), as the page shows it."""
    match = re.search(r"run directory\s+(\S+)", seat.page.evaluate(NOTEBOOK_TEXT))
    assert match, f"{seat.user}'s page shows no run directory"
    return match.group(1)
