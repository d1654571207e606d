"""Byte-level tokenizer: token ids 0..255 are the bytes of UTF-8 text, plus a few specials.

Prompts and answers stay readable, so a leaked page shows up as another request's text.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

import numpy as np

BYTE_TOKENS = 256
BOS = 256
EOS = 257
PAD = 258
CONFLICT = 259  # the replay model's answer when heads or layers disagree
VOCAB_SIZE = 260
TOKEN_BITS = 9  # bits needed to write any token id
SPECIAL_NAMES = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>", CONFLICT: "<conflict>"}


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def encode_array(text: str) -> np.ndarray:
    """:func:`encode` as int32 (``[len]``), made in numpy: a million-token prompt in a
    millisecond, not a Python int per token."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<i4")


def token_count(text: str) -> int:
    """``len(encode_array(text))`` without the array: a byte a token, so the prompt's
    length is known (and refused) before four bytes a token are spent on it. An ASCII
    text is its own length; another is encoded once, one byte a token."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def decode(tokens: Iterable[int], *, show_specials: bool = True) -> str:
    """Bytes back to text (invalid UTF-8 replaced); specials rendered as ``<name>`` or dropped."""
    whole = StreamDecoder(show_specials=show_specials)
    return whole.feed(tokens) + whole.finish()


class StreamDecoder:
    """Incremental :func:`decode` for an answer that arrives in chunks: a character whose
    bytes are split between two chunks is held back until its last byte arrives, so the
    concatenation of what :meth:`feed` and :meth:`finish` return equals ``decode`` of all
    the tokens, for any tokens and any split."""

    def __init__(self, *, show_specials: bool = True) -> None:
        self.show_specials = show_specials
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for token in tokens:
            token = int(token)
            if 0 <= token < BYTE_TOKENS:
                run.append(token)
                continue
            if token not in SPECIAL_NAMES:
                raise ValueError(f"token {token} outside vocabulary of {VOCAB_SIZE}")
            out.append(self._utf8.decode(bytes(run), final=True))  # a special ends a run
            run.clear()
            if self.show_specials:
                out.append(SPECIAL_NAMES[token])
        out.append(self._utf8.decode(bytes(run)))
        return "".join(out)

    def finish(self) -> str:
        """What is still held back (an incomplete character at the end: replaced)."""
        return self._utf8.decode(b"", final=True)
