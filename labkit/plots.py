"""Figure helpers shared by every lab: projector-sized axes, a moving average, PNG bytes.

Every labkit figure is a :class:`matplotlib.figure.Figure` built without pyplot (no global state,
safe from a background thread) and shown as PNG bytes (:func:`render_png`) in an ipywidgets
``Image`` or an IPython display. Figures are pure functions of their data, so they are tested
without a kernel.

**Legible where it is shown.** A notebook's output area is about :data:`OUTPUT_WIDTH_PX` wide (JupyterLab
at 1,400 px with the file browser open); a wider PNG is shrunk by the browser, and its text with it.
:func:`render_png` renders no wider than that, so the browser shows it 1:1, and :func:`illegible_texts`
lists every text smaller than :data:`MIN_TEXT_PX` there. With ``LABKIT_STRICT_FIGURES=1`` in the environment
(the test suite sets it), rendering such a figure is an error that names the texts.
"""
from __future__ import annotations

import io
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from labkit.text import OUTPUT_WIDTH_PX

FIGURE_WIDTH = 9.5  # inches at 100 dpi: a lab's figure, 950 px, shown 1:1 within OUTPUT_WIDTH_PX
MIN_TEXT_PX = 12.0  # the smallest text a room can read on a projector, as shown


def display_dpi(fig: Figure) -> float:
    """The dpi :func:`render_png` uses: the figure's own, lowered until it is no wider than OUTPUT_WIDTH_PX."""
    return min(fig.dpi, OUTPUT_WIDTH_PX / fig.get_size_inches()[0])


def text_sizes_px(fig: Figure) -> list[tuple[str, float]]:
    """Every text the figure draws (titles, labels, tick labels, legends, annotations) and its height in pixels
    as shown (font size at :func:`display_dpi`)."""
    FigureCanvasAgg(fig).draw()  # tick labels get their text when drawn
    scale = display_dpi(fig) / 72
    texts = fig.findobj(match=lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
    return [(t.get_text(), t.get_fontsize() * scale) for t in texts if t.get_visible() and t.get_text().strip()]


def illegible_texts(fig: Figure, min_px: float = MIN_TEXT_PX) -> list[str]:
    """The texts shown smaller than ``min_px`` pixels, each with its size: empty for a legible figure."""
    return [f"{text!r} at {px:.1f} px" for text, px in text_sizes_px(fig) if px < min_px - 1e-9]


def render_png(fig: Figure) -> bytes:
    """The figure as PNG bytes (what ``W.Image(value=...)`` and ``IPython.display.Image`` show), no wider than
    a notebook's output area. Under ``LABKIT_STRICT_FIGURES=1``, a ValueError if any text would be illegible."""
    if os.environ.get("LABKIT_STRICT_FIGURES") == "1":
        small = illegible_texts(fig)
        if small:
            title = fig._suptitle.get_text() if fig._suptitle else ""
            raise ValueError(f"figure {title!r} is illegible at {OUTPUT_WIDTH_PX} px: " + "; ".join(small[:8]))
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=display_dpi(fig))
    return buf.getvalue()


def label_axes(ax, title: str, xlabel: str, ylabel: str, legend: bool = True) -> None:
    """Projector-sized title, labels and legend, and a light grid."""
    ax.set_title(title, fontsize=14)
    ax.set_xlabel(xlabel, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=11)


def moving_average(values, window: int) -> list[float]:
    """Trailing mean over up to ``window`` values, same length as ``values`` (drawn over noisy curves)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
