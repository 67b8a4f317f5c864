"""What `marsched loadgen` replays: sessions, each a list of turns sent one after the other.

A turn is one model call: its prompt, the length its reply must have, and the time between
the end of its reply and the next turn (the tool's or the agent's time). A prompt is either
the trace's own text (`TextPrompt`: agent-text) or an instruction to grow the session's
context (`GrownPrompt`: the token-count traces, where the client keeps the context as a real
agent does, its own replies included; `marsched.loadgen.filler`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Send this text as the prompt, whatever came before."""

    text: str


@dataclass(frozen=True, slots=True)
class GrownPrompt:
    """The previous turn's prompt and reply (all of it, or only its first `kept_tokens`: the client
    compacted its context), then `new_tokens` of filler: what the tool returned, or, for a session's
    first turn (kept 0), the whole prompt."""

    kept_tokens: int | None
    new_tokens: int


Prompt = TextPrompt | GrownPrompt


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: Prompt
    reply_tokens: int  # the trace's reply length, what the bench's logits processor forces
    gap_s: float  # from this reply's end to the next turn's request (0 after the last turn)


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation of the trace. `parent` is set for a session that another one starts (a
    subagent): it starts when its parent's turn `parent_turn` has ended (that turn's tool call
    is the subagent), beside its parent."""

    key: str  # unique in its workload; no '/' (it becomes a marsched conversation id)
    turns: tuple[Turn, ...]
    parent: str | None = None
    parent_turn: int = 0

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.key!r}: no turns")
        if "/" in self.key:
            raise ValueError(f"session {self.key!r}: a key has no '/'")

    def first_turns(self, limit: int) -> Session:
        """The session cut to its first `limit` turns (0: all of them)."""
        if limit <= 0 or limit >= len(self.turns):
            return self
        kept = self.turns[:limit - 1] + (Turn(self.turns[limit - 1].prompt, self.turns[limit - 1].reply_tokens, 0.0),)
        return Session(self.key, kept, self.parent, self.parent_turn)


def shape_gap(gap_s: float, scale: float, cap_s: float | None) -> float:
    """A trace's gap as replayed: × `scale`, at most `cap_s` (None: no cap)."""
    gap = max(gap_s, 0.0) * scale
    return gap if cap_s is None else min(gap, cap_s)
