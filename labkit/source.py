"""Read the code beside the experiment: ``show_source(obj)`` for a lab's "Read the code" cells.

A lab that turns the knobs of ``ddp_bucketed`` should also show the forty lines that *are*
``ddp_bucketed`` (d2l's habit). ``show_source`` finds an object's source with :mod:`inspect` and
returns a :class:`Source`, which Jupyter draws as a highlighted, numbered listing headed by where it
lives — ``labkit/parallel/dp/ddp.py, lines 171–181`` — so a learner can open the file at that line.
Outside Jupyter the same object prints as plain numbered text.

    >>> from labkit.source import show_source
    >>> from labkit.parallel.dp.ddp import BucketedDDP
    >>> show_source(BucketedDDP._launch)            # the whole method
    >>> show_source(BucketedDDP, lines=(26, 36))    # just the heart of a long class: its lines 26–36
"""
from __future__ import annotations

import html
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from labkit.text import OUTPUT_WIDTH_PX

PACKAGE_ROOT = Path(__file__).resolve().parent  # .../labkit: paths are shown from here ("labkit/...")
FONT = "font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
FONT_PX = 13  # JupyterLab's own code size: on a projector the same as the cells above the listing
# The characters one listing line holds, line number included, before it scrolls sideways: a notebook's output
# area less padding and border, over a monospace advance of 0.602 em.
LISTING_CHARS = int((OUTPUT_WIDTH_PX - 2 * 12 - 2) / (0.602 * FONT_PX))  # 120
CODE_STYLE = (f"{FONT}; font-size: {FONT_PX}px; line-height: 1.45; white-space: pre; overflow-x: auto; margin: 0; "
              "padding: 8px 12px; background: #f8f8f8; color: #1f2328; border: 1px solid #d0d7de; "
              "border-radius: 0 0 6px 6px")
HEAD_STYLE = (f"{FONT}; font-size: 13px; padding: 4px 12px; background: #eaeef2; color: #1f2328; "
              "border: 1px solid #d0d7de; border-bottom: none; border-radius: 6px 6px 0 0")
NUMBER_STYLE = "color: #8c959f; user-select: none"  # line numbers: seen, but not copied with the code


@dataclass(frozen=True)
class Source:
    """Lines ``first``…``last`` of ``path``: the source of ``name`` (or the slice of it asked for)."""

    name: str  # the object's qualified name, e.g. "BucketedDDP._launch"
    path: str  # where it lives, e.g. "labkit/parallel/dp/ddp.py"
    first: int  # the file's line number of the listing's first line
    text: str  # the listing, dedented, one "\n"-terminated line per line

    @property
    def last(self) -> int:
        return self.first + len(split_lines(self.text)) - 1

    @property
    def heading(self) -> str:
        where = f"line {self.first}" if self.first == self.last else f"lines {self.first}–{self.last}"
        return f"{self.path}, {where} · {self.name}"

    def numbers(self) -> list[str]:
        """The file's line numbers, right-aligned to one width so the code's indentation stays true."""
        width = len(str(self.last))
        return [f"{n:>{width}}  " for n in range(self.first, self.last + 1)]

    def __repr__(self) -> str:
        return "\n".join([self.heading, *map(str.__add__, self.numbers(), split_lines(self.text))])

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        rows = [f'<span style="{NUMBER_STYLE}">{n}</span>{line}'
                for n, line in zip(self.numbers(), highlighted_lines(self.text))]
        return (f'<div class="labkit-source" style="margin: 6px 0">'
                f'<div style="{HEAD_STYLE}">{html.escape(self.heading)}</div>'
                f'<pre style="{CODE_STYLE}">' + "\n".join(rows) + "</pre></div>")


def split_lines(text: str) -> list[str]:
    """``text``'s lines, split at "\\n" only — as Python reads a file, so the numbers match the file's."""
    return text.removesuffix("\n").split("\n")


def highlighted_lines(text: str) -> list[str]:
    """Python source as HTML, one string per line, colours inline (any Jupyter front end, no stylesheet).

    Pygments closes its spans at every line end, so the lines can be numbered one by one. Pygments
    comes with IPython; without it the code is shown escaped but uncoloured.
    """
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:
        return [html.escape(line) for line in split_lines(text)]
    return split_lines(highlight(text, PythonLexer(stripnl=False), HtmlFormatter(nowrap=True, noclasses=True)))


def shown_path(file: str) -> str:
    """``labkit/...`` for labkit's own files; else the path from the deepest ``sys.path`` entry holding it."""
    path = Path(file).resolve()
    if path.is_relative_to(PACKAGE_ROOT):
        return path.relative_to(PACKAGE_ROOT.parent).as_posix()
    roots = [Path(entry).resolve() for entry in sys.path if entry]
    roots = [root for root in roots if path.is_relative_to(root) and path != root]
    return path.relative_to(max(roots, key=lambda root: len(root.parts))).as_posix() if roots else path.as_posix()


def target_of(obj):
    """The function whose source ``obj`` stands for: a classmethod's or a property's, a decorator's inner one."""
    return inspect.unwrap(getattr(obj, "__func__", getattr(obj, "fget", obj)))


def source_lines(obj) -> tuple[list[str], int, str]:
    """``(lines, first line number, file)`` of ``obj``, or a TypeError/ValueError that says why not."""
    target = target_of(obj)
    try:
        lines, first = inspect.getsourcelines(target)
        file = inspect.getsourcefile(target)
    except TypeError as error:  # a builtin, an instance, a number...
        raise TypeError(f"show_source needs a Python function, class, method or module, not {obj!r} "
                        f"({type(obj).__name__}): only those are written in a source file") from error
    except OSError as error:  # defined in a REPL, or shipped without its .py file
        raise ValueError(f"show_source found no source file for {obj!r}: {error}") from error
    if file is None:
        raise ValueError(f"show_source found no source file for {obj!r}")
    return lines, max(first, 1), file  # a module starts at line 0 in inspect's count


def show_source(obj, lines: tuple[int, int] | None = None) -> Source:
    """The source of a function, class, method or module, ready for a notebook to display.

    ``lines=(start, end)`` shows only lines start…end of the object, counted from its first line
    (its ``def``, or the decorator above it) as 1, both ends included — the heart of a long function.
    The heading still gives the file's own line numbers. Raises TypeError for objects without Python
    source (builtins, instances) and ValueError for a ``lines`` range outside the object.
    """
    text_lines, first, file = source_lines(obj)
    if lines is not None:
        start, end = check_range(lines, len(text_lines), obj)
        text_lines, first = text_lines[start - 1:end], first + start - 1
    target = target_of(obj)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(obj)
    return Source(name=name, path=shown_path(file), first=first, text=textwrap.dedent("".join(text_lines)))


def check_range(lines, length: int, obj) -> tuple[int, int]:
    """``lines`` as ``(start, end)`` inside 1…length, or a ValueError naming what would fit."""
    pair = isinstance(lines, (tuple, list)) and len(lines) == 2
    if not pair or not all(isinstance(n, int) and not isinstance(n, bool) for n in lines):
        raise ValueError(f"lines must be a pair (start, end) of whole line numbers, got {lines!r}")
    start, end = lines
    if not 1 <= start <= end <= length:
        raise ValueError(f"lines={tuple(lines)!r} is outside {getattr(obj, '__qualname__', obj)}, which has lines "
                         f"1–{length}: pick 1 <= start <= end <= {length}")
    return start, end
