"""How long first come first served would make a request arriving now wait.

While the engine is busy, every policy serves work at about the same rate; they differ
only in whose work. A request arriving now would wait, under first come first served,
until the work already in the system is served: the unserved work over the rate the
engine serves it. Work is counted in tokens the engine computes (`predicted_work_tokens`:
the prompt, every output token and every returned token, as predicted), since prefill and
decode share each iteration's token budget: a request brings its predicted total when it
first enters the queue, and each token computed for it serves one unit, never more than
it brought (one that finishes early has the rest served at its end; a recompute serves
nothing new once its work is used up). The rate is the work served over the last
`RATE_WINDOW_S` seconds of busy time (stretches in which nothing was computed do not
count), so that it follows the mix being served without the noise of single iterations.

Until a rate is measured (the first iteration, or a stretch longer than the window with
nothing computed) the estimate falls back on the wait of the oldest request first come
first served would not yet have started: had the work served so far gone in arrival
order, every request whose predecessors' work is all served would have started. That
one lags the forward estimate while the queue grows (it is the wait of a request that
arrived when the queue was shorter), which is why it is only the fallback.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from marsched.policy.program import ProgramOutlook
from marsched.predict.segment import SegmentPrediction

# Served work within this of an arrival's cumulative work counts as having reached it.
_WORK_SLACK = 1e-9
# The service rate is measured over this much of the recent past, from this many samples of it.
RATE_WINDOW_S = 60.0
_SAMPLES_PER_WINDOW = 64


def predicted_work_tokens(prompt_tokens: int, predictions: Sequence[SegmentPrediction],
                          program: ProgramOutlook | None = None) -> int:
    """Tokens the engine computes for a request over its life, as predicted: the prompt, every
    output token, and the tokens each call returns when another segment follows it; with a
    program outlook (the rest learnt, not read), the turns it expects, each adding its growth."""
    returned = sum(p.api_return_tokens for p in predictions[:-1])
    rest = 0 if program is None else round(program.turns_left * program.growth_tokens)
    return prompt_tokens + sum(p.output_tokens for p in predictions) + returned + rest


@dataclass(slots=True)
class FcfsWait:
    window_s: float = RATE_WINDOW_S
    _arrived: deque[tuple[float, float]] = field(default_factory=deque)  # (entered s, cumulative work before it)
    _arrived_work: float = 0.0
    _served_work: float = 0.0
    _owed: dict[str, float] = field(default_factory=dict)  # request id -> its work not yet served
    _samples: deque[tuple[float, float, float]] = field(default_factory=deque)  # (s, served work, busy s so far)
    _busy_s: float = 0.0
    _last_call: tuple[float, float] | None = None  # (s, served work) at the last rate query

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"the service-rate window must be > 0 s, got {self.window_s}")

    @property
    def served_tokens(self) -> float:
        return self._served_work

    @property
    def unserved_tokens(self) -> float:
        return max(self._arrived_work - self._served_work, 0.0)

    def knows(self, request_id: str) -> bool:
        return request_id in self._owed

    def arrive(self, request_id: str, entered_s: float, work_tokens: float) -> None:
        """A request enters the queue for the first time with `work_tokens` predicted to compute."""
        work = max(float(work_tokens), 1.0)
        self._arrived.append((entered_s, self._arrived_work))
        self._arrived_work += work
        self._owed[request_id] = work

    def served(self, request_id: str, tokens: int) -> None:
        """The engine computed `tokens` for the request (prefill or decode)."""
        owed = self._owed.get(request_id)
        if owed is None or tokens <= 0:
            return
        served = min(float(tokens), owed)
        self._owed[request_id] = owed - served
        self._served_work += served

    def finished(self, request_id: str) -> None:
        self._served_work += self._owed.pop(request_id, 0.0)

    def wait_s(self, now_s: float) -> float:
        """The estimated wait of a request arriving at `now_s` (calls come in time order)."""
        rate = self.service_rate(now_s)
        oldest = self.oldest_unstarted_wait_s(now_s)  # also forgets the arrivals FCFS would have started
        unserved = self.unserved_tokens
        if unserved <= _WORK_SLACK:
            return 0.0
        return oldest if rate is None else unserved / rate

    def service_rate(self, now_s: float) -> float | None:
        """Work served per busy second over the last window (None until some was served). The time
        between two calls counts as busy if work was served in it: engines call once a step."""
        if self._last_call is not None:
            last_s, last_served = self._last_call
            if self._served_work > last_served:
                self._busy_s += now_s - last_s
        self._last_call = (now_s, self._served_work)
        samples = self._samples
        if not samples or now_s - samples[-1][0] >= self.window_s / _SAMPLES_PER_WINDOW:
            samples.append((now_s, self._served_work, self._busy_s))
        while len(samples) > 1 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()  # the oldest kept sample is the last one at or before the window's start
        _, first_served, first_busy = samples[0]
        _, last_served, last_busy = samples[-1]
        busy, served = last_busy - first_busy, last_served - first_served
        return served / busy if busy > 0 and served > 0 else None

    def oldest_unstarted_wait_s(self, now_s: float) -> float:
        """How long the oldest request first come first served would not have started has waited."""
        arrived = self._arrived
        while arrived and arrived[0][1] < self._served_work - _WORK_SLACK:
            arrived.popleft()  # FCFS would have started it: its queue wait is over
        return max(now_s - arrived[0][0], 0.0) if arrived else 0.0
