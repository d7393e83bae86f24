"""Labs 01, 02, 03, 05, 08, 10 and 13 fit a notebook's output area (968 px: JupyterLab at 1,400 px with the file
browser open): no row of widgets wider than it, no button label cut, no printed line that wraps."""
import io

import ipywidgets as W
import pytest
import torch
from PIL import Image

from helpers import tiny_config
from labkit.plots import OUTPUT_WIDTH_PX
from labkit.text import PRINT_WIDTH, too_wide, wrap
from labkit.widgets import cap, data_parallel, flash, memory_calculator, moe, scaling, scaling_out
from labkit.widgets import model_parallel as mp

from lab_data import CAP_RUNS, DP_ROWS, SPLIT, TP_ROWS, activation_row, cap_summary, memory_row


def children(widget) -> list:
    return list(getattr(widget, "children", ()) or ())


def walk(widget):
    """The widget and every widget inside it."""
    yield widget
    for child in children(widget):
        yield from walk(child)


def px(length) -> float:
    """A CSS length in pixels; 0 for one that adapts to the space it is given (auto, %, unset)."""
    return float(length[:-2]) if isinstance(length, str) and length.endswith("px") else 0.0


def png_width(widget) -> float:
    """The width of the PNG an image widget shows (its value: bytes or a memoryview); 0 for any other widget."""
    value = getattr(widget, "value", None) if isinstance(widget, W.Image) else None
    return float(Image.open(io.BytesIO(bytes(value))).size[0]) if value else 0.0


def least_width(widget) -> float:
    """The narrowest the widget can be laid out without clipping or shrinking a picture: a row adds its children
    up, a column, a wrapping row or a grid takes its widest child; a picture is as wide as its PNG."""
    inner = [least_width(c) for c in children(widget)]
    layout = widget.layout
    if isinstance(widget, W.HBox) and "wrap" not in (layout.flex_flow or ""):
        content = sum(inner)
    else:
        content = max(inner, default=0.0)
    return max(content, px(layout.width), px(layout.min_width), png_width(widget))


def labs():
    fitted = {"E": 2.0, "A": 100.0, "B": 100.0, "alpha": 0.5, "beta": 0.3}
    return {"01 CAP": cap.CapLab(tiny_config(), quick=True).widget(),
            "02 data parallel": data_parallel.DataParallelLab(tiny_config()).widget(),
            "02 memory calculator": memory_calculator.MemoryCalculator().widget(),
            "03 model parallel": mp.ModelParallelLab(tiny_config(**{"model.n_layer": 2}), nproc=2).widget(),
            "05 online softmax": flash.OnlineSoftmaxExplorer().widget(),
            "08 planner": scaling.BudgetPlanner(fitted, 1e10, tokens_per_step=2048, floor=2.1).widget(),
            "10 scaling out": scaling_out.ScalingOutLab().widget(),
            "13 routing explorer": moe.RoutingExplorer().widget()}


@pytest.fixture(scope="module")
def widgets():
    return labs()


def test_no_lab_is_wider_than_the_output_area(widgets):
    widths = {name: least_width(widget) for name, widget in widgets.items()}
    assert all(w <= OUTPUT_WIDTH_PX for w in widths.values()), widths


def test_the_memory_calculator_stacks_its_bars_under_controls_that_wrap(widgets):
    calculator = widgets["02 memory calculator"]
    assert isinstance(calculator, W.VBox)
    grids = [w for w in walk(calculator) if isinstance(w, W.GridBox)]
    assert grids and "auto-fill" in grids[0].layout.grid_template_columns
    assert 0 < png_width(children(calculator)[-1]) <= OUTPUT_WIDTH_PX


def test_every_button_is_as_wide_as_its_label(widgets):
    """A button's default width (about 148 px) cuts "Compare all modes"; toggle buttons cut "fitted on this sweep"."""
    buttons = [(name, w) for name, widget in widgets.items() for w in walk(widget) if isinstance(w, W.Button)]
    toggles = [(name, w) for name, widget in widgets.items() for w in walk(widget) if isinstance(w, W.ToggleButtons)]
    assert {w.description for _, w in buttons} >= {"Run", "Compare all modes", "Compare"} and len(toggles) == 2
    assert [(name, w.description) for name, w in buttons if w.layout.width != "auto"] == []
    assert [(name, w.description) for name, w in toggles if w.style.button_width != "auto"] == []


# ---------------------------------------------------------------- printed text


def test_wrap_breaks_long_lines_on_word_boundaries_and_keeps_the_rest():
    long = "word " * 40 + "a-hyphenated-word " + "end"
    text = f"short line\n\n{long}"
    wrapped = wrap(text, indent="  ")
    assert wrapped.startswith("short line\n\n") and not too_wide(wrapped)
    assert wrapped.split() == text.split()  # no word broken, none lost
    assert all(line.startswith("  ") for line in wrapped.splitlines()[3:])
    assert too_wide(long) == [long] and len(long) > PRINT_WIDTH


def _cap_summaries():
    return [{**cap_summary(mode, busy, div), "staleness_max": 12, "staleness_bound": 4}
            for mode, busy, div in CAP_RUNS]


def test_printed_tables_and_verdicts_fit_on_a_line():
    from labkit.consistency.report import comparison_rows

    summaries = _cap_summaries()
    table = cap.comparison_text(comparison_rows(summaries))
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["sync", "local_sgd", "ssp", "async"]
    texts = {"01 comparison": table, **{f"01 verdict {s['consistency']}": cap.verdict_text(s) for s in summaries}}
    texts["02 peaks"] = data_parallel.peak_table(DP_ROWS)
    texts["03 bytes"] = mp.tp_bytes_text(TP_ROWS + [("dtensor m=2", {**TP_ROWS[0][1], "measured_total": None,
                                                                     "measured_per_layer": None})])
    texts["03 memory"] = mp.memory_text([("pp=2 × tp=2 1f1b m=4", [memory_row(0, 0, 1.6e6)])])
    texts["03 split"] = mp.split_text([("pp=2 × tp=2 1f1b m=4", SPLIT),
                                       ("torch", {**SPLIT, "bubble_counted": False, "model_comm_counted": False})])
    texts["03 activations"] = mp.activation_text([("pp=2 1f1b m=8", {"rows": [activation_row(0, 2e6, 8)],
                                                                     "why_not": "x " * 80})])
    texts["05 steps"] = "\n".join(flash.step_line(s) for s in flash.online_softmax_steps(torch.randn(16) * 3, 4))
    assert {name: too_wide(text) for name, text in texts.items() if too_wide(text)} == {}
    assert "recovery" in table and "in partition" in table
    assert "gave up A" in cap.verdict_text(summaries[0]) and "<b>" not in cap.verdict_text(summaries[0])


def test_the_source_the_read_the_code_cells_show_fits_on_a_line():
    """Every lab's Read-the-code listing (``show_source``), line numbers included, needs no sideways scroll
    at the output width."""
    from pathlib import Path

    from helpers import run_read_the_code_cells
    from labkit.source import LISTING_CHARS

    shown = [source for path in sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
             for source in run_read_the_code_cells(path)]
    assert {s.name for s in shown} >= {"stage_order", "step_time", "Trainer.step", "training_state"}
    wide = {source.name: too_wide(repr(source).split("\n", 1)[1], LISTING_CHARS) for source in shown}
    assert {name: lines for name, lines in wide.items() if lines} == {}


def test_no_control_label_is_cut():
    """A slider's or dropdown's label is cut with an ellipsis past its description width (80 px unless set): about
    7.5 px a character in JupyterLab's 13 px widget font."""
    cut = []
    for name, widget in labs().items():
        for w in walk(widget):
            text, style = getattr(w, "description", ""), getattr(w, "style", None)
            if text and not isinstance(w, (W.Button, W.Checkbox)) and hasattr(style, "description_width"):
                if 7.5 * len(text) > (px(style.description_width) or 80):
                    cut.append((name, text, style.description_width))
    assert cut == []
