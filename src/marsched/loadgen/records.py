"""What a replay measures: one record per turn sent, one per conversation (an arrival of a session)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class TurnRecord:
    index: int  # in its conversation, from 0; turns after the first are follow-ups
    sent_s: float  # since the start of the run
    target_tokens: int  # the reply length asked for (the trace's)
    ttft_s: float | None = None  # to the first streamed token
    latency_s: float | None = None  # to the reply's end
    prompt_tokens: int | None = None  # the server's count (usage)
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # one line: what failed

    @property
    def finished(self) -> bool:
        return self.error is None and self.latency_s is not None

    @property
    def end_s(self) -> float | None:
        return None if self.latency_s is None else self.sent_s + self.latency_s

    def exact(self, max_tokens: int) -> bool:
        """Whether the reply had the asked length (or `max_tokens`, the cap, if that is less)."""
        return self.finished and self.completion_tokens == min(self.target_tokens, max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ConversationRecord:
    conversation: str  # "<session key>#<n>"
    session: str
    arrival_s: float  # when it was due; its first turn is sent then
    turns_planned: int
    turns: list[TurnRecord] = field(default_factory=list)
    started: bool = False
    end_s: float | None = None  # its last turn's reply ended (or a turn failed: the conversation stops)

    @property
    def failed(self) -> bool:
        return any(turn.error for turn in self.turns)

    @property
    def finished(self) -> bool:
        return self.end_s is not None and not self.failed and len(self.turns) == self.turns_planned

    @property
    def e2e_s(self) -> float | None:
        """Arrival to the end of its last reply, tool gaps included; None unless finished."""
        return self.end_s - self.arrival_s if self.finished else None

    def to_dict(self) -> dict[str, Any]:
        return {"conversation": self.conversation, "session": self.session, "arrival_s": self.arrival_s,
                "turns_planned": self.turns_planned, "started": self.started, "finished": self.finished,
                "failed": self.failed, "e2e_s": self.e2e_s, "turns": [turn.to_dict() for turn in self.turns]}
