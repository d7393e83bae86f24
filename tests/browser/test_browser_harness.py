"""The browser checks can fail: a notebook with a traceback, a broken image and a cell left unrun is caught."""
import json

import pytest
from browser_lab import close_notebook, page_problems, run_all

pytestmark = [pytest.mark.multiproc, pytest.mark.notebook, pytest.mark.browser]

CELLS = ["import ipywidgets as W\nW.Image(format='png')  # empty: the browser's broken-image icon",
         "print('fine')", "raise ValueError('boom')", "print('never reached')"]


def test_the_page_checks_find_an_error_a_broken_image_and_an_unrun_cell(lab, page):
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
              "source": source} for i, source in enumerate(CELLS)]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "zz_harness_check.ipynb").write_text(json.dumps(notebook))
    run_all(page, lab, "zz_harness_check.ipynb", timeout_s=120)
    problems = page_problems(page)
    close_notebook(page)
    assert any(p.startswith("error output") and "boom" in p for p in problems), problems
    assert any(p.startswith("broken image") for p in problems), problems
    assert "1 code cell(s) never ran" in problems, problems
