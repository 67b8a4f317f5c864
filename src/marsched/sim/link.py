"""The host link: KV transfers in one direction, first in first out, at a fixed bandwidth.

Transfers run beside compute; what the link moves in an iteration is the per-iteration
swap budget (bandwidth × iteration time), so swapping never stalls the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


_DONE = 1e-6  # tokens; what float rounding may leave of a finished transfer


@dataclass(slots=True, eq=False)
class Transfer:
    owner: Any
    tokens_left: float
    blocks: int


@dataclass(slots=True)
class HostLink:
    tokens_per_s: float
    _queue: deque[Transfer] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._queue)

    def start(self, owner: Any, tokens: int, blocks: int) -> Transfer:
        transfer = Transfer(owner, float(tokens), blocks)
        self._queue.append(transfer)
        return transfer

    def cancel(self, transfer: Transfer) -> None:
        self._queue.remove(transfer)

    def seconds_to_next_completion(self) -> float | None:
        if not self._queue:
            return None
        return self._queue[0].tokens_left / self.tokens_per_s

    def advance(self, seconds: float) -> list[Transfer]:
        """Move data for `seconds`; returns the transfers that completed, in order."""
        capacity = seconds * self.tokens_per_s
        done: list[Transfer] = []
        while self._queue and capacity > 0:
            head = self._queue[0]
            moved = min(head.tokens_left, capacity)
            head.tokens_left -= moved
            capacity -= moved
            if head.tokens_left <= _DONE:
                done.append(self._queue.popleft())
        # A transfer of zero tokens completes at once.
        while self._queue and self._queue[0].tokens_left <= _DONE:
            done.append(self._queue.popleft())
        return done
