"""A broken rule found in a trace, told with the request, the time and the events involved."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Check(str, Enum):
    POLICY = "policy"  # the trace declares the policy it is audited as
    ORDER = "order"  # admissions follow the ranking key, promoted requests first
    STRATEGY = "strategy"  # assigned before the segment's first token, never changed
    STARVATION = "starvation"  # the counter, the threshold, the promotion
    PROTECTION = "protection"  # no protected request is preempted
    LIFECYCLE = "lifecycle"  # no request lost, none finished twice
    MEMORY = "memory"  # within capacity, nothing held at the end


@dataclass(frozen=True, slots=True)
class Violation:
    check: Check
    rid: str | None
    t: float
    message: str
    lines: tuple[int, ...] = field(default=())  # the events involved, by line number

    def __str__(self) -> str:
        who = f"request {self.rid}" if self.rid is not None else "engine"
        where = ", ".join(str(n) for n in sorted(set(self.lines)))
        return f"[{self.check.value}] {who} at t={self.t:.6g}s: {self.message} (trace line{'s' if len(set(self.lines)) > 1 else ''} {where})"
