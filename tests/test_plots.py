"""Figures are shown no wider than a notebook's output area, and text smaller than 12 px there is caught."""
import io

import pytest
from matplotlib.figure import Figure
from PIL import Image

from labkit import plots


def _figure(width_in: float, fontsize: float) -> Figure:
    fig = Figure(figsize=(width_in, 3), dpi=100)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set_title("title", fontsize=fontsize)
    ax.tick_params(labelsize=fontsize)
    ax.legend(fontsize=fontsize)
    return fig


def test_a_wide_figure_is_rendered_at_the_output_width_and_its_small_text_flagged():
    wide = _figure(18, 12)  # 1,800 px at its own dpi: the browser would shrink it to 968
    png = plots.render_png(wide)
    assert Image.open(io.BytesIO(png)).size[0] == plots.OUTPUT_WIDTH_PX
    small = plots.illegible_texts(wide)
    assert small and all("px" in s for s in small)  # 12 pt at 968/18 dpi ≈ 9 px
    assert not plots.illegible_texts(_figure(9.5, 12))  # 950 px wide: 12 pt is 16.7 px


def test_strict_mode_refuses_to_render_an_illegible_figure(monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT_FIGURES", "1")
    with pytest.raises(ValueError, match="illegible at 968 px"):
        plots.render_png(_figure(18, 12))
    assert plots.render_png(_figure(9.5, 12)).startswith(b"\x89PNG")
