"""Figure helpers shared by every lab: projector-sized axes, a moving average, PNG bytes.

Every labkit figure is a :class:`matplotlib.figure.Figure` built without pyplot (no global state,
safe from a background thread) and shown as PNG bytes (:func:`render_png`) in an ipywidgets
``Image`` or an IPython display. Figures are pure functions of their data, so they are tested
without a kernel.
"""
from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def render_png(fig: Figure) -> bytes:
    """The figure as PNG bytes (what ``W.Image(value=...)`` and ``IPython.display.Image`` show)."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
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
