"""The main buttons of labs 00, 07 and 01 pressed in the browser, and a slider of lab 13 moved, with what a person
would then see asserted.

Each press function runs after the notebook's Run All, on the widgets its cells displayed: it clicks as a person
would (Playwright finds the button by its label) and waits for the page to show the outcome, or fails saying what
it saw instead.
"""
from __future__ import annotations

import re
import time

OUTPUTS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea"
LIVE_STEPS = 400  # 00's run when Run is pressed: long enough for the dashboard to draw while it goes

WIDGET_STATE = """heading => {
    // the output of the widget whose <h3> says `heading`: its status text and the images it shows
    const h = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea h3')]
        .find(e => e.textContent.includes(heading));
    if (!h) return null;
    const box = h.closest('.jp-OutputArea-output');
    const shown = [...box.querySelectorAll('img')].filter(i => i.offsetParent !== null && i.naturalWidth > 0);
    // a dashboard's live sketch is an inline SVG (labkit.widgets.sketch): a frame too, told apart by a hash
    const sketches = [...box.querySelectorAll('svg.labkit-sketch')].filter(s => s.getBoundingClientRect().width > 0)
        .map(s => { let h = 0; for (const c of s.outerHTML) h = (h * 31 + c.charCodeAt(0)) | 0; return 'sk' + h; });
    return {text: box.innerText, images: [...sketches, ...shown.map(i => i.src)]};
}"""


REVEAL = """heading => {
    // JupyterLab skips the rendering of cells out of view (content-visibility): scroll the widget into view first
    const h = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea h3')]
        .find(e => e.textContent.includes(heading));
    if (!h) return false;
    h.scrollIntoView({block: 'start'});
    return true;
}"""


def button(page, heading: str, label: str):
    """The button labelled ``label`` of the widget headed ``heading``, scrolled into view as a person would."""
    assert page.evaluate(REVEAL, heading), f"no widget headed {heading!r} on the page"
    widget = page.locator(f"{OUTPUTS} .jp-OutputArea-output").filter(has=page.locator("h3", has_text=heading))
    # its accessible name starts with the icon's glyph (Font Awesome's ::before content), then the label
    found = widget.get_by_role("button", name=re.compile(rf"^\W*{re.escape(label)}$")).first
    found.wait_for(state="visible", timeout=10_000)
    return found


def set_slider(page, heading: str, label: str, value: int) -> None:
    """Type ``value`` into the readout of the slider labelled ``label``, as a person does, and check it took."""
    widget = page.locator(f"{OUTPUTS} .jp-OutputArea-output").filter(has=page.locator("h3", has_text=heading))
    slider = widget.locator(".widget-slider").filter(has=page.locator("label.widget-label", has_text=label)).first
    readout = slider.locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(str(value))
    page.keyboard.press("Enter")
    page.wait_for_function("([e, v]) => e.textContent.trim() === v", arg=[readout.element_handle(), str(value)],
                           timeout=5_000)


def widget_state(page, heading: str) -> dict:
    state = page.evaluate(WIDGET_STATE, heading)
    assert state is not None, f"no widget headed {heading!r} on the page"
    return state


def wait_until(page, heading: str, done, timeout_s: float, what: str) -> dict:
    """Poll the widget's state until ``done(state)``; fail with the text last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = widget_state(page, heading)
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:.0f} s, still no {what}; the widget says:\n{state['text'][-1500:]}")
        page.wait_for_timeout(250)


def press_quickstart(page) -> str:
    """00: Run → the dashboard appears under the panel, its picture changes while the run goes, and the headline
    ends with the run's status."""
    heading = "Run configuration"
    button(page, heading, "Run")  # scrolled into view
    set_slider(page, heading, "steps", LIVE_STEPS)  # quick mode's 30 steps end before a live frame is due
    button(page, heading, "Run").click()
    frames: set[str] = set()

    def finished(state):
        frames.update(state["images"])
        return "— finished" in state["text"] and not button(page, heading, "Run").is_disabled()

    state = wait_until(page, heading, finished, 240, "finished run in the dashboard's headline")
    assert len(frames) >= 2, f"the dashboard showed {len(frames)} distinct frame(s): its picture never changed"
    return f"Run: {len(frames)} distinct dashboard frames; headline: {state['text'].splitlines()[-1][:120]}"


def press_fault_lab(page) -> str:
    """07: Start run → training; Kill rank 1 → the status line says where it resumed and how fast, and the
    recovery chart is drawn; Compare with a clean run → a bit-for-bit verdict after the fault."""
    heading = "Fault tolerance"
    before = set(widget_state(page, heading)["images"])
    button(page, heading, "Start run").click()
    wait_until(page, heading, lambda s: "training: step" in s["text"], 120, "training progress line")
    button(page, heading, "Kill rank 1").click()
    state = wait_until(page, heading, lambda s: "resumed at step" in s["text"] and "recovered in" in s["text"]
                       and not button(page, heading, "Start run").is_disabled(), 240,
                       "'resumed at step …, recovered in' line")
    assert set(state["images"]) - before, "the recovery chart was not redrawn for the lab's run"
    button(page, heading, "Compare with a clean run").click()
    state = wait_until(page, heading, lambda s: "✔ after" in s["text"] or "✘ after" in s["text"]
                       or "cannot compare" in s["text"], 240, "comparison verdict")
    assert "✔ after" in state["text"], state["text"][-800:]
    return "Kill rank 1: " + next(line for line in state["text"].splitlines() if "✔" in line)[:160]


def press_cap_lab(page) -> str:
    """01: Compare all modes → every mode runs again and the comparison chart is redrawn."""
    heading = "CAP trade-offs"
    before = widget_state(page, heading)
    button(page, heading, "Compare all modes").click()
    state = wait_until(page, heading, lambda s: saved_line(s) not in ("", saved_line(before)), 300,
                       "new comparison saved")
    assert state["images"] and state["images"][-1] != before["images"][-1], "the comparison chart was not redrawn"
    return f"Compare all modes: {saved_line(state)}"


def press_moe_explorer(page) -> str:
    """13: the routing explorer's loss-free bias slider moved → its sentences say the bias moved, and its picture is
    redrawn (computed in the kernel: no run)."""
    heading = "Routing explorer"
    assert page.evaluate(REVEAL, heading), f"no widget headed {heading!r} on the page"
    before = widget_state(page, heading)
    set_slider(page, heading, "loss-free bias moves", 100)
    state = wait_until(page, heading, lambda s: "after 100 moves" in s["text"] and s["images"] != before["images"], 30,
                       "sentence about the bias's 100 moves and a redrawn picture")
    return "loss-free bias moves = 100: " + next(line for line in state["text"].splitlines()
                                                  if "after 100 moves" in line)[:120]


def saved_line(state: dict) -> str:
    """The CAP lab's last line after a comparison: where its table was saved (a new name each time)."""
    return next((line for line in state["text"].splitlines() if line.startswith("saved ")), "")


PRESSES = {"00_quickstart.ipynb": press_quickstart, "07_fault_tolerance.ipynb": press_fault_lab,
           "01_cap_tradeoffs.ipynb": press_cap_lab, "13_mixture_of_experts.ipynb": press_moe_explorer}
