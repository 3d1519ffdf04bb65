"""Turning a stream of token pieces (bytes) into text without ever printing a broken character.

A multi-byte UTF-8 character can be split across tokens (byte-fallback tokens do this for
emoji and CJK). The decoder holds back an incomplete tail until the bytes that finish it arrive.
"""

from __future__ import annotations

import codecs
from typing import Callable, Iterable


class TextStream:
    """Incremental detokenizer: feed token ids, get the text that is complete so far."""

    def __init__(self, piece: Callable[[int], bytes]):
        """`piece(token)` returns the bytes a token renders to."""
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        """Text completed by these tokens (may be empty while a character is incomplete)."""
        return self._decoder.decode(b"".join(self._piece(t) for t in tokens))

    def flush(self) -> str:
        """Whatever is held back, with an invalid tail shown as U+FFFD; ends the stream."""
        return self._decoder.decode(b"", final=True)
