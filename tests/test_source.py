"""``labkit.source.show_source`` and the labs' "Read the code" cells that use it.

The listing must be the file's own lines under the file's own line numbers (a learner opens the file
there), and every lab's Read-the-code cell must name an object that still exists: the notebook cells
are checked here without a kernel, by running just their imports and their ``show_source`` calls.
"""
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.consistency.parameter_server import may_read
from labkit.parallel.dp.ddp import BucketedDDP
from helpers import read_the_code_cells, run_read_the_code_cells
from labkit.source import show_source

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LABS = sorted(p for p in NOTEBOOKS.glob("[01][0-9]_*.ipynb") if int(p.name[:2]) <= 10)  # 11, the capstone, reads scores
NOT_YET: set[str] = set()  # labs allowed without a Read-the-code cell: none


def test_a_method_is_shown_with_its_path_from_the_package_and_its_file_line_numbers():
    shown = show_source(BucketedDDP._launch)
    lines, first = inspect.getsourcelines(BucketedDDP._launch)
    assert (shown.path, shown.first, shown.last) == ("labkit/parallel/dp/ddp.py", first, first + len(lines) - 1)
    assert shown.text == textwrap.dedent("".join(lines))
    assert shown.text.startswith("def _launch(")  # dedented out of its class
    page = shown._repr_html_()
    assert f"labkit/parallel/dp/ddp.py, lines {shown.first}–{shown.last}" in page
    assert "_launch" in page and "async_op" in page
    for n in range(shown.first, shown.last + 1):
        assert re.search(rf">\s*{n}  </span>", page), n  # every line carries its number


def test_the_listing_is_legible_on_a_projector_and_scrolls_rather_than_wraps():
    page = show_source(BucketedDDP._hook)._repr_html_()
    sizes = [int(px) for px in re.findall(r"font-size:\s*(\d+)px", page)]
    assert sizes and min(sizes) >= 13
    assert "white-space: pre;" in page and "overflow-x: auto" in page


def test_code_is_escaped_and_coloured():
    page = show_source(may_read)._repr_html_()
    assert "&lt;=" in page and "<=" not in page.replace("<span", "").replace("</", "")
    assert '<span style="color:' in page  # pygments' inline colours: no stylesheet needed


def test_without_pygments_the_code_is_still_shown_escaped(monkeypatch):
    monkeypatch.setitem(sys.modules, "pygments", None)  # import pygments → ImportError
    page = show_source(may_read)._repr_html_()
    assert "&lt;=" in page and "def may_read" in page


def test_lines_shows_a_slice_under_the_file_s_numbers():
    lines, first = inspect.getsourcelines(BucketedDDP)
    shown = show_source(BucketedDDP, lines=(3, 5))
    assert (shown.first, shown.last) == (first + 2, first + 4)
    assert shown.text == textwrap.dedent("".join(lines[2:5]))
    assert show_source(BucketedDDP, lines=(1, len(lines))) == show_source(BucketedDDP)


def test_plain_text_fallback_numbers_every_line():
    shown = show_source(may_read)
    text = repr(shown)
    assert text.splitlines()[0] == shown.heading
    assert text.splitlines()[1].startswith(f"{shown.first}  def may_read(")
    assert len(text.splitlines()) == 1 + shown.last - shown.first + 1
    from IPython.lib.pretty import pretty
    assert pretty(shown) == text


def test_jupyter_displays_the_html_with_the_text_beside_it():
    from IPython.core.formatters import DisplayFormatter
    shown = show_source(may_read)
    data, _ = DisplayFormatter().format(shown)
    assert data["text/html"] == shown._repr_html_() and data["text/plain"] == repr(shown)


def test_a_file_outside_labkit_is_shown_from_its_sys_path_entry():
    shown = show_source(json.dumps)
    assert shown.path == "json/__init__.py" and shown.name == "dumps"


@pytest.mark.parametrize("obj", [len, 3, object()], ids=["builtin", "int", "instance"])
def test_an_object_without_python_source_is_a_type_error_that_says_so(obj):
    with pytest.raises(TypeError, match="show_source needs a Python function, class, method or module"):
        show_source(obj)


@pytest.mark.parametrize("lines", [(0, 2), (2, 1), (1, 10_000), (1,), "1-3", (1.0, 2), (True, 2)])
def test_a_bad_lines_range_is_a_value_error(lines):
    with pytest.raises(ValueError, match="lines"):
        show_source(may_read, lines=lines)


# ---------------------------------------------------------------- the labs' Read-the-code cells

@pytest.mark.parametrize("path", [p for p in LABS if p.name not in NOT_YET], ids=lambda p: p.name)
def test_every_lab_has_a_read_the_code_cell(path):
    assert read_the_code_cells(path), f"{path.name}: no code cell calls show_source("


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_every_object_a_read_the_code_cell_names_exists_and_shows(path):
    shown = run_read_the_code_cells(path)
    assert len(shown) >= len(read_the_code_cells(path))
    for source in shown:
        assert source.name.rsplit(".", 1)[-1] in source._repr_html_(), source.heading


def test_each_read_the_code_cell_follows_a_markdown_cell_that_says_what_to_look_for():
    for path in LABS:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, c in enumerate(cells):
            if c["cell_type"] == "code" and "show_source(" in "".join(c["source"]):
                before = cells[i - 1]
                assert before["cell_type"] == "markdown" and "Read the code" in "".join(before["source"]), path.name


def test_a_property_is_shown_by_its_getter():
    from labkit.precision import Precision
    shown = show_source(Precision.peak_dtype)
    assert shown.name == "Precision.peak_dtype" and "def peak_dtype" in shown.text
