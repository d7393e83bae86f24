"""Character and byte tokenizers: text <-> integer ids, vectorized with NumPy.

A tokenizer fixes what "one token" means, and so the unit of the loss: a
model's cross-entropy is measured in nats *per token*.  With the character
tokenizer every symbol of a shipped corpus is exactly one token, so the loss
is directly comparable with the corpus' entropy floor
(``entropy_nats_per_token`` in its metadata).  The byte tokenizer works on
any text (vocabulary: the 256 byte values) but a non-ASCII character becomes
several tokens, so its per-token loss is not per character.

Both encode by turning the whole string into a NumPy array at once, instead
of a Python loop over characters: a million characters take milliseconds.
"""
from __future__ import annotations

from typing import Iterable, Union

import numpy as np

Ids = Union[np.ndarray, Iterable[int]]


def _code_points(text: str) -> np.ndarray:
    """Unicode code point of every character, as one uint32 array (no loop)."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def _as_id_array(ids: Ids, vocab_size: int) -> np.ndarray:
    # np.asarray takes lists, arrays and CPU torch tensors alike
    arr = np.asarray(ids if hasattr(ids, "__len__") else list(ids), dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return arr


class CharTokenizer:
    """One token per distinct character; ids follow sorted character order.

    Sorting makes the mapping a function of the *set* of characters only, so
    the same alphabet always gives the same ids, whatever text it came from.
    """

    kind = "char"

    def __init__(self, alphabet: str):
        chars = sorted(set(alphabet))
        if not chars:
            raise ValueError("CharTokenizer needs at least one character in its alphabet")
        self.alphabet = "".join(chars)
        self._code_points = _code_points(self.alphabet)  # sorted, for searchsorted

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> np.ndarray:
        """int64 array of ids; ValueError naming the first unknown character."""
        cps = _code_points(text)
        ids = np.searchsorted(self._code_points, cps)
        found = self._code_points[np.minimum(ids, self.vocab_size - 1)] == cps
        if not found.all():
            pos = int(np.argmin(found))
            raise ValueError(
                f"character {text[pos]!r} (U+{ord(text[pos]):04X}) at position {pos} is not in "
                f"this tokenizer's vocabulary of {self.vocab_size} characters {self.alphabet!r}; "
                "build the tokenizer from text that contains it, or use the byte tokenizer"
            )
        return ids.astype(np.int64)

    def decode(self, ids: Ids) -> str:
        arr = _as_id_array(ids, self.vocab_size)
        return self._code_points[arr].astype("<u4").tobytes().decode("utf-32-le")

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: any text works, vocab is 256."""

    kind = "byte"
    vocab_size = 256

    @classmethod
    def from_text(cls, text: str = "") -> "ByteTokenizer":
        return cls()  # nothing to learn from the text; kept for a uniform interface

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Ids) -> str:
        """Bytes back to text; invalid UTF-8 (a model's sample may cut a
        multi-byte character in half) is shown as U+FFFD instead of failing."""
        arr = _as_id_array(ids, self.vocab_size)
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


Tokenizer = Union[CharTokenizer, ByteTokenizer]

TOKENIZERS = {
    "char": CharTokenizer,
    "byte": ByteTokenizer,
}


def build_tokenizer(kind: str, text: str) -> Tokenizer:
    """A tokenizer of the given kind ("char" or "byte") fitted to `text`."""
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {kind!r} (choose one of: {', '.join(TOKENIZERS)})")
    return TOKENIZERS[kind].from_text(text)
