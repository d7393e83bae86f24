"""Printed text that fits a notebook's output area without wrapping mid-word.

JupyterLab breaks a printed line that is wider than the output area anywhere, even inside a word. The output
area is about 968 px wide (:data:`OUTPUT_WIDTH_PX`: 1,400 px with the file browser open), about 120
characters of its 13 px monospace font; labkit's prose and tables stay within :data:`PRINT_WIDTH` characters,
with a margin. :func:`wrap` breaks prose on word boundaries; tables are designed that narrow.
"""
from __future__ import annotations

import re
import textwrap

OUTPUT_WIDTH_PX = 968  # a notebook output area: JupyterLab at 1,400 px, file browser open
PRINT_WIDTH = 100  # characters per printed line


def plain(html: str) -> str:
    """Text with its HTML tags removed (``<b>A</b>`` → ``A``; ``<br>`` → a new line), for printing."""
    return re.sub(r"<[^>]+>", "", re.sub(r"<br\s*/?>", "\n", html))


def wrap(text: str, width: int = PRINT_WIDTH, indent: str = "") -> str:
    """Each line of ``text`` broken on word boundaries into lines of at most ``width`` characters; the lines a long
    one is broken into start with ``indent``. Blank lines and short lines are kept as they are."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) if len(line) > width else line
                     for line in text.split("\n"))


def too_wide(text: str, width: int = PRINT_WIDTH) -> list[str]:
    """The lines of ``text`` longer than ``width`` characters: empty for text that prints without wrapping."""
    return [line for line in text.splitlines() if len(line) > width]
