"""Predictions from the past only, learnt online: the knowable default (`--predictor online`,
`--api-estimator past-mean`).

A server predicts a segment from what it has served: the replies and calls of the requests that
came before, and the request's own earlier segments. Neither predictor here reads the segment's
own length, its call or anything later; they get a `RequestPast` (`workload/past.py`).

- `OnlineLength`: the mean reply of the segments served so far of the same task class and
  position (a request's first segment, or a later one), from a prior of `PRIOR_TOKENS`; for a
  later segment, pulled toward the request's own earlier replies (each counts as much as the
  class mean), so that a conversation's replies predict its next.
- `PastMeanApi`: per tool, the geometric mean of the calls seen so far (as `TypeMeanApi`), for
  the tool the next call most likely uses: the request's latest call's, else its class's, else
  the mean over every tool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from marsched.predict.api_duration import SHORTEST_S, ApiEstimate
from marsched.workload.model import ApiType, Request
from marsched.workload.past import RequestPast

DEFAULT_PREDICTOR = "online"  # the simulator's and compare's default: knowable
DEFAULT_API_ESTIMATOR = "past-mean"
PRIOR_TOKENS = 100.0  # a reply's length before any segment of its kind ended
PRIOR_DURATION_S = 1.0  # a call's duration before any call was seen
PRIOR_RETURN_TOKENS = 20.0  # a call's return before any call was seen
OWN_WEIGHT = 1.0  # the class mean counts as this many of the request's own replies


@dataclass(slots=True)
class RunningMean:
    """A sum and a count, for a mean kept as values arrive."""

    total: float = 0.0
    count: float = 0.0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def mean(self, default: float) -> float:
        return self.total / self.count if self.count else default

    def shrunk(self, prior: float, weight: float) -> float:
        """The mean, with `prior` counted as `weight` observations."""
        return (self.total + weight * prior) / (self.count + weight)


def position_of(past: RequestPast) -> str:
    """The position predictions are grouped by: a request's first segment, or a later one."""
    return "first" if not past.done else "later"


@dataclass
class OnlineLength:
    """Output lengths from the segments served so far (module docstring)."""

    name: str = "online"
    knowable: bool = True
    _by_class: dict[tuple[str, str], RunningMean] = field(default_factory=dict)
    _by_position: dict[str, RunningMean] = field(default_factory=dict)

    def class_mean(self, past: RequestPast) -> float:
        position = position_of(past)
        # No segment of this position served yet: the other position's mean, else the prior.
        overall = self._by_position.get(position) or next(iter(self._by_position.values()), RunningMean())
        known = self._by_class.get((past.task_class, position))
        return known.mean(overall.mean(PRIOR_TOKENS)) if known else overall.mean(PRIOR_TOKENS)

    def predict_past(self, past: RequestPast) -> int:
        mean = self.class_mean(past)
        own = [s.output_tokens for s in past.done]
        return max(1, round(RunningMean(sum(own), len(own)).shrunk(mean, OWN_WEIGHT)))

    def predict(self, request: Request, segment_index: int) -> int:
        return self.predict_past(RequestPast.of(request, segment_index))

    def observe_output(self, past: RequestPast, output_tokens: int) -> None:
        """The segment that started with `past` generated `output_tokens`."""
        position = position_of(past)
        self._by_class.setdefault((past.task_class, position), RunningMean()).add(output_tokens)
        self._by_position.setdefault(position, RunningMean()).add(output_tokens)


@dataclass
class PastMeanApi:
    """Call durations and returns from the calls seen so far (module docstring)."""

    name: str = "past-mean"
    knowable: bool = True
    _log_durations: dict[str, RunningMean] = field(default_factory=dict)
    _returns: dict[str, RunningMean] = field(default_factory=dict)

    def _pool(self, pools: dict[str, RunningMean], kind: str) -> RunningMean | None:
        return pools.get(kind) or pools.get("")

    def estimate_past(self, past: RequestPast) -> ApiEstimate:
        kind = past.call_type_guess
        durations = self._pool(self._log_durations, kind)
        returns = self._pool(self._returns, kind)
        duration_s = math.exp(durations.mean(0.0)) if durations else PRIOR_DURATION_S
        return ApiEstimate(duration_s, round(returns.mean(PRIOR_RETURN_TOKENS)) if returns else round(PRIOR_RETURN_TOKENS))

    def estimate(self, request: Request, segment_index: int) -> ApiEstimate:
        return self.estimate_past(RequestPast.of(request, segment_index))

    def observe(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        for kind in (api_type.value, ""):  # the tool's pool and the pool of every tool
            self._log_durations.setdefault(kind, RunningMean()).add(math.log(max(duration_s, SHORTEST_S)))
            self._returns.setdefault(kind, RunningMean()).add(return_tokens)

    def declare(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        """A tool's stated expectation counts as one call of it, until calls of it are seen."""
        if api_type.value not in self._log_durations:
            self._log_durations[api_type.value] = RunningMean(math.log(max(duration_s, SHORTEST_S)), 1.0)
            self._returns[api_type.value] = RunningMean(float(return_tokens), 1.0)
