"""Filler text of a given token count, and the context of a token-count session that grows by it.

Token-count traces (claude-code) have no text. The client writes filler for their prompts and
tool results: words drawn at random from `WORDS`, each one token with its leading space in the
GPT-2, Llama, Mistral and Qwen vocabularies, in `marsched model`'s default tokenizer and in the
tests' tiny model, so that n words are about n tokens on whatever model the server runs; the
server's `usage.prompt_tokens`, in the report, says how close. (A `marsched model` built with a
small `--vocab` splits them: 512 tokens give 2.3 a word.) Each session draws its own words (seeded by its conversation id), so
that two sessions share no prefix by accident.

A session's context is kept as a real agent keeps it: each turn's prompt is the previous
prompt, the reply the server actually sent, and the new filler (`GrownPrompt`). When the
trace's client compacted its context (`kept_tokens`), only the context's first `kept_tokens`
are kept: whole pieces, and the piece across the boundary cut in proportion to its length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from marsched.loadgen.session import GrownPrompt

WORDS = ("the", "and", "to", "in", "is", "for", "by", "an", "are")


def filler(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of text: that many words, each with a leading space."""
    return "".join(" " + rng.choice(WORDS) for _ in range(tokens))


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    tokens: int


def _cut(piece: Piece, tokens: int) -> Piece:
    """The piece's first `tokens` tokens (its first characters in that proportion)."""
    if tokens >= piece.tokens:
        return piece
    return Piece(piece.text[:len(piece.text) * tokens // max(piece.tokens, 1)], tokens)


@dataclass(slots=True)
class GrowingContext:
    """One session's context; `grow` gives each turn's prompt, `add_reply` appends the reply."""

    rng: random.Random
    pieces: list[Piece] = field(default_factory=list)

    @classmethod
    def for_conversation(cls, conversation_id: str) -> GrowingContext:
        return cls(random.Random(conversation_id))

    @property
    def tokens(self) -> int:
        return sum(piece.tokens for piece in self.pieces)

    def grow(self, prompt: GrownPrompt) -> str:
        if prompt.kept_tokens is not None:
            kept: list[Piece] = []
            left = prompt.kept_tokens
            for piece in self.pieces:
                if left <= 0:
                    break
                kept.append(_cut(piece, left))
                left -= kept[-1].tokens
            self.pieces = kept
        if prompt.new_tokens:
            self.pieces.append(Piece(filler(prompt.new_tokens, self.rng), prompt.new_tokens))
        return "".join(piece.text for piece in self.pieces)

    def add_reply(self, text: str, tokens: int) -> None:
        self.pieces.append(Piece(text, tokens))
