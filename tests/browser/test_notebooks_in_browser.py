"""Every notebook in real JupyterLab in real Chromium, as a workshop room runs it: Run All, then look.

A person at 1,400 px with the file browser open would see no traceback, no broken image and no widget that
failed to render; the run leaves no worker process behind. In 00, 07 and 01 the main buttons are then pressed, in
13 a slider is moved, and what the page shows is checked (``presses.py``). Each notebook's Run All time is printed
(it is not asserted: timings live in benchmarks/), and a screenshot of the page is kept in
``test-artifacts/browser/``.
"""
import time

import pytest
from browser_lab import NOTEBOOKS, close_notebook, page_problems, run_all, screenshot
from helpers import processes_mentioning
from presses import PRESSES

pytestmark = [pytest.mark.multiproc, pytest.mark.notebook, pytest.mark.browser]


@pytest.mark.parametrize("notebook", [nb.name for nb in NOTEBOOKS])
def test_run_all_shows_no_error_no_broken_image_and_every_widget(lab, page, notebook):
    seconds = run_all(page, lab, notebook)
    print(f"{notebook}: Run All {seconds:.1f} s in the browser (quick mode)")
    try:
        screenshot(page, notebook.removesuffix(".ipynb"))
        problems = page_problems(page)
        if not problems and notebook in PRESSES:
            try:
                print(PRESSES[notebook](page))
            finally:
                screenshot(page, notebook.removesuffix(".ipynb") + "-buttons")
            problems = page_problems(page)
    finally:
        close_notebook(page)  # its kernel and workers end even when a check failed
    assert not problems, "\n".join(problems)
    deadline = time.monotonic() + 30  # the kernel is gone; its workers must be gone too
    while leftovers(lab) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers(lab), "processes outlived the notebook's kernel"


def leftovers(lab) -> list[int]:
    """Processes started from the served folder (kernels, workers), JupyterLab itself aside."""
    return [pid for pid in processes_mentioning(str(lab.root)) if pid != lab.process.pid]
