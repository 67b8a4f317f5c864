"""MiniLM's word pieces of many texts, with the pieces of each whitespace-separated chunk cached.

Tokenizing is most of what a prediction costs (docs/predictor.md, "Latency"), and agent turns
repeat their words: paths, commands, log lines, the same tool output. The tokenizer (BERT's
normalizer, pre-tokenizer and WordPiece) splits at every whitespace character and never joins
across one, and its normalizing is per character. So the pieces of a text are the pieces of its
chunks between spaces, tabs and newlines, in order. Only the chunks not seen before go to the
tokenizer, in one batch. A test checks the pieces equal the tokenizer's own on the bundled
agent turns and on text made to trip it (control characters, accents, CJK, other spaces).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

CHUNK = re.compile(r"[ \t\n\r]+")  # whitespace the tokenizer keeps as such (\v and \f it deletes)
MAX_CACHED = 200_000  # chunks; the cache starts over when full (about 40 MiB at worst)
MAX_CACHED_CHARS = 100  # longer chunks are tokenized every time: rare, and each is one [UNK] or more


class PieceCache:
    """Chunk -> its word-piece ids, for one tokenizer."""

    def __init__(self, tokenizer: Any, limit: int = MAX_CACHED) -> None:
        self._tokenizer = tokenizer
        self._limit = limit
        self._pieces: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._pieces)

    def pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text's word pieces, as `tokenizer.encode(text, add_special_tokens=False)` gives."""
        chunked = [[chunk for chunk in CHUNK.split(text) if chunk] for text in texts]
        batch = {chunk for chunks in chunked for chunk in chunks}
        new = [chunk for chunk in batch if chunk not in self._pieces]
        if len(self._pieces) + len(new) > self._limit:
            self._pieces, new = {}, list(batch)  # start over: this batch tokenizes all its chunks
        long: dict[str, list[int]] = {}
        for chunk, encoding in zip(new, self._tokenizer.encode_batch(new, add_special_tokens=False) if new else ()):
            (self._pieces if len(chunk) <= MAX_CACHED_CHARS else long)[chunk] = encoding.ids
        result = []
        for chunks in chunked:
            ids: list[int] = []
            for chunk in chunks:
                ids.extend(long[chunk] if chunk in long else self._pieces[chunk])
            result.append(ids)
        return result
