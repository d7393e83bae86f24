"""A picture that says what it is waiting for until its first frame arrives.

An empty ``ipywidgets.Image`` shows the browser's broken-image icon — in front of a room, it looks like a bug.
:class:`Picture` holds a line of text in its place (``waiting``) and swaps in the image the moment a frame is
set, and back to the text if the frame is cleared. It is used like an ``Image``: assign PNG bytes to
``.value``.
"""
from __future__ import annotations

from html import escape

import ipywidgets as W

PLACEHOLDER_STYLE = ("font-size:1.1em;color:#666;border:1px dashed #bbb;border-radius:4px;"
                     "padding:24px;text-align:center;max-width:640px")


class Picture(W.VBox):
    """A PNG image with a placeholder line shown until (and whenever) it has no frame."""

    def __init__(self, waiting: str = "no picture yet", max_width: str = "100%"):
        self._image = W.Image(format="png", layout=W.Layout(max_width=max_width, display="none"))
        self._waiting = W.HTML()
        super().__init__([self._waiting, self._image])
        self.waiting = waiting

    @property
    def waiting(self) -> str:
        """The placeholder's text."""
        return self._waiting_text

    @waiting.setter
    def waiting(self, text: str) -> None:
        self._waiting_text = text
        self._waiting.value = f"<div style='{PLACEHOLDER_STYLE}'>{escape(text)}</div>"

    @property
    def value(self) -> bytes:
        """The PNG shown (b"" while waiting)."""
        return self._image.value

    @value.setter
    def value(self, png: bytes) -> None:
        self._image.value = png or b""
        shown = bool(png)
        self._image.layout.display = None if shown else "none"
        self._waiting.layout.display = "none" if shown else None

    @property
    def showing_placeholder(self) -> bool:
        return self._image.layout.display == "none"
