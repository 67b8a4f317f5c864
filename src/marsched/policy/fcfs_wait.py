"""How long first come first served would make a request arriving now wait.

While the engine is busy, every policy serves work at about the same rate; they differ
only in whose work. Had the work served so far gone in arrival order, first come first
served would have started every request whose predecessors' work is all served; the
oldest request it would not have started has been waiting for `now - entered`, about
what a request arriving now would wait. Work is counted in predicted output tokens: a
request brings its predicted total when it first enters the queue, and each token it
decodes serves one unit of it, never more than it brought (one that finishes early has
the rest served at its end). What has been served therefore never runs ahead of what
arrived, and a request arriving to an idle engine sees a wait of 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Served work within this of an arrival's cumulative work counts as having reached it.
_WORK_SLACK = 1e-9


@dataclass(slots=True)
class FcfsWait:
    _arrived: deque[tuple[float, float]] = field(default_factory=deque)  # (entered s, cumulative work before it)
    _arrived_work: float = 0.0
    _served_work: float = 0.0
    _owed: dict[str, float] = field(default_factory=dict)  # request id -> its work not yet served

    @property
    def served_tokens(self) -> float:
        return self._served_work

    def knows(self, request_id: str) -> bool:
        return request_id in self._owed

    def arrive(self, request_id: str, entered_s: float, work_tokens: float) -> None:
        """A request enters the queue for the first time with `work_tokens` predicted to decode."""
        work = max(float(work_tokens), 1.0)
        self._arrived.append((entered_s, self._arrived_work))
        self._arrived_work += work
        self._owed[request_id] = work

    def decoded(self, request_id: str, tokens: int) -> None:
        owed = self._owed.get(request_id)
        if owed is None or tokens <= 0:
            return
        served = min(float(tokens), owed)
        self._owed[request_id] = owed - served
        self._served_work += served

    def finished(self, request_id: str) -> None:
        self._served_work += self._owed.pop(request_id, 0.0)

    def wait_s(self, now_s: float) -> float:
        arrived = self._arrived
        while arrived and arrived[0][1] < self._served_work - _WORK_SLACK:
            arrived.popleft()  # FCFS would have started it: its queue wait is over
        return max(now_s - arrived[0][0], 0.0) if arrived else 0.0
