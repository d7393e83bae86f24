"""The dashboard's live picture, light enough to redraw every two seconds beside the run it watches.

A matplotlib frame of the six panels costs a core 0.2–0.35 s to draw; on a 2-core laptop every such second is taken
from a worker, and one frame every 2 s costs the run several percent. While a run goes, the dashboard shows this
sketch instead: the first four panels of :data:`~labkit.widgets.dashboard_panels.PANELS` (loss with validation,
throughput, MFU, communication in flight and exposed) as an SVG string — a few milliseconds of Python; the
browser draws the lines. When the run ends the full matplotlib picture takes its place (and stays in the saved
notebook). :func:`sketch_svg` is a pure function of the events, tested without a browser.
"""
from __future__ import annotations

import math
import textwrap
from html import escape

from labkit.metrics.communication import exposed_frac
from labkit.metrics.events import final_trajectory
from labkit.plots import moving_average
from labkit.widgets.dashboard_panels import PANELS, SMOOTH, world_sizes

WIDTH, PANEL_H, TITLE_H, GAP = 1400, 250, 44, 70  # px of the viewBox; shown at the output area's width
FONT, SMALL = 22, 18  # px: legible from the back of a room on a projector
MAX_POINTS = 150  # per line: a long run's curve thinned evenly (the last point always kept); a panel is 550 units
# of the viewBox wide, so 150 points are 3-4 units apart: the page parses and paints less each frame
COLOURS = {"raw": "#9ecae1", "main": "#1f77b4", "val": "#ff7f0e", "exposed": "#d62728"}
CLASS = "labkit-sketch"  # what a page (or a test) finds the sketch by
HEADLINE_CHARS, LINE_H = 105, 32  # the status line on top: wrapped at this many characters, lines this far apart


def nice_ticks(low: float, high: float, count: int = 4) -> list[float]:
    """About ``count`` round numbers (1, 2 or 5 × 10^k apart) spanning [low, high]."""
    if not high > low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value < high + step * 0.999:
        ticks.append(round(value, 12))
        value += step
    return ticks


def short(value: float) -> str:
    """A tick's label: 120k for 120,000; 3.2 for 3.2; 0.05 for 0.05."""
    if abs(value) >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:.3g}"


def thinned(points: list[tuple[float, float]], most: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most ``most`` of ``points``, evenly spaced, the last one kept."""
    if len(points) <= most:
        return points
    stride = math.ceil(len(points) / most)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def panel_series(events: list[dict]) -> list[dict]:
    """Each panel's title, unit and lines ``(name, colour, points, width)``, from the steps of the run's final
    trajectory; validation points and the exposed share join the loss and communication panels."""
    steps = final_trajectory(events)
    panels = []
    for key, name, ylabel, scale in PANELS:
        points = [(e["step"], e[key] * scale) for e in steps if e.get(key) is not None]
        lines = []
        if len(points) >= 2 * SMOOTH and key != "loss":
            smooth = list(zip([p[0] for p in points], moving_average([p[1] for p in points], SMOOTH)))
            lines += [("per step", COLOURS["raw"], points, 1.5), (f"mean of {SMOOTH}", COLOURS["main"], smooth, 3)]
        elif points:
            lines.append(("train" if key == "loss" else ylabel, COLOURS["main"], points, 2.5))
        if key == "loss":
            evals = [(e["step"], e["val_loss"]) for e in events if e.get("type") == "eval" and "val_loss" in e]
            if evals:
                lines.append(("validation", COLOURS["val"], evals, 3))
        if key == "comm_frac":
            shares = [(e["step"], 100 * exposed_frac(e)) for e in steps if exposed_frac(e) is not None]
            if shares:
                ys = moving_average([v for _, v in shares], SMOOTH)
                lines.append(("exposed", COLOURS["exposed"], list(zip([s for s, _ in shares], ys)), 3))
        panels.append({"title": name, "unit": ylabel, "lines": lines, "percent": scale == 100.0})
    return panels


def _panel(panel: dict, x0: float, y0: float, w: float, h: float, steps: tuple[float, float],
           marks: list[tuple[float, str]] = ()) -> list[str]:
    """One panel's SVG elements: frame, y ticks, the first and last step, lines, title, a legend of its lines, and
    ``marks`` (a restart's or a reshard's step, with its colour) as dotted verticals."""
    out = [f'<text x="{x0}" y="{y0 - 12}" font-size="{FONT}" font-weight="bold">{escape(panel["title"])}</text>']
    ys = [y for _, _, points, _ in panel["lines"] for _, y in points]
    if not ys:
        out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#bbb"/>')
        out.append(f'<text x="{x0 + w / 2}" y="{y0 + h / 2}" font-size="{SMALL}" fill="gray" '
                   f'text-anchor="middle">not measured yet</text>')
        return out
    low, high = (0.0, max(100.0, max(ys))) if panel["percent"] and panel["unit"] == "%" else (min(ys), max(ys))
    ticks = nice_ticks(low, high)
    low, high = ticks[0], ticks[-1]
    (s0, s1) = steps

    def px(step, value):
        return (x0 + (step - s0) / ((s1 - s0) or 1) * w, y0 + h - (value - low) / ((high - low) or 1) * h)

    for tick in ticks:
        _, y = px(s0, tick)
        out.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x0 - 8}" y="{y + 6:.1f}" font-size="{SMALL}" text-anchor="end">{short(tick)}</text>')
    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    for end, anchor in ((s0, "start"), (s1, "end")):
        out.append(f'<text x="{px(end, low)[0]:.1f}" y="{y0 + h + 22}" font-size="{SMALL}" fill="#555" '
                   f'text-anchor="{anchor}">{end:g}</text>')
    for step, colour in marks:
        x, _ = px(step, low)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + h}" stroke="{colour}" stroke-width="3" '
                   f'stroke-dasharray="4 4"/>')
    for i, (label, colour, points, width) in enumerate(panel["lines"]):
        path = " ".join(f"{a:.0f},{b:.0f}" for a, b in (px(*p) for p in thinned(points)))  # a unit: <= a pixel
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="{width}"/>')
        out.append(f'<text x="{x0 + w - 8}" y="{y0 + 24 + 22 * i}" font-size="{SMALL}" text-anchor="end" '
                   f'fill="{colour}">{escape(label)}</text>')
    return out


def sketch_svg(events: list[dict], title: str = "", headline: str = "") -> str:
    """The live sketch of a run's events: an SVG document (as a string) scaled to its container's width; with
    ``headline`` (the dashboard's status line) on top, wrapped, so that one output holds both."""
    panels = panel_series(events)
    steps = [e["step"] for e in final_trajectory(events)]
    span = (min(steps), max(steps)) if steps else (0, 1)
    start = next((e for e in events if e.get("type") == "start"), {})
    heading = title or (f"{world_sizes(events)} × {start.get('backend')} on {start.get('device')}" if start else "")
    height = TITLE_H + 2 * (PANEL_H + GAP) + 44
    body = [f'<text x="{WIDTH / 2}" y="30" font-size="{FONT + 2}" text-anchor="middle">'
            f'{escape(heading)} · live sketch, steps {span[0]}–{span[1]}</text>']
    marks = [(e["next_step"], "#8172B3" if e.get("resharded") else "#C44E52") for e in events
             if e.get("type") == "resume" and "next_step" in e]
    w = (WIDTH - 3 * 100) / 2
    for i, panel in enumerate(panels):
        x0 = 100 + (i % 2) * (w + 100)
        y0 = TITLE_H + GAP / 2 + 10 + (i // 2) * (PANEL_H + GAP)
        body += _panel(panel, x0, y0, w, PANEL_H, span, marks if i == 0 else ())
    body.append(f'<text x="{WIDTH / 2}" y="{height - 6}" font-size="{SMALL}" fill="#555" text-anchor="middle">'
                f'steps → (dotted: a restart; the full picture, all six panels, is drawn when the run ends)</text>')
    lines = textwrap.wrap(headline, HEADLINE_CHARS)
    top = [f'<text x="10" y="{30 + LINE_H * i}" font-size="{FONT + 2}" font-weight="bold">{escape(line)}</text>'
           for i, line in enumerate(lines)]
    shift = LINE_H * len(lines) + (10 if lines else 0)
    return (f'<svg class="{CLASS}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height + shift}" '
            f'width="100%" style="max-width:{WIDTH}px;font-family:sans-serif">' + "".join(top)
            + f'<g transform="translate(0 {shift})">' + "".join(body) + "</g></svg>")
