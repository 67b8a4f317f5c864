"""API-duration and return-length estimators, per API type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from marsched.workload.model import ApiType, Request


@dataclass(slots=True)  # not frozen: built per segment at every segment start
class ApiEstimate:
    duration_s: float
    return_tokens: int


class ApiEstimator(Protocol):
    name: str

    def estimate(self, request: Request, segment_index: int) -> ApiEstimate: ...

    def observe(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None: ...

    def declare(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class OracleApi:
    """The call's true duration and return length from the trace."""

    name: str = "oracle"

    def estimate(self, request: Request, segment_index: int) -> ApiEstimate:
        api = request.segments[segment_index].api
        if api is None:
            return ApiEstimate(0.0, 0)
        return ApiEstimate(api.duration_s, api.return_tokens)

    def observe(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        pass

    def declare(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        pass


@dataclass(slots=True)
class _RunningMean:
    total: float
    weight: float

    @property
    def mean(self) -> float:
        return self.total / self.weight


SHORTEST_S = 1e-6  # durations are averaged in log space; a call of 0 s counts as this


@dataclass(slots=True)
class TypeMeanApi:
    """Online means, per API type, of the observed durations and return lengths, started from a prior.

    The prior counts as `prior_weight` observations, so the first calls of a new type
    are not taken at face value; after a few calls the observations dominate.
    Durations are averaged in log space (a geometric mean): across types they span
    five orders of magnitude (0.1 ms to 60 s in the INFERCEPT mixture), and an
    arithmetic mean would keep a 1 s prior dominant over many 0.1 ms calls.
    """

    prior_duration_s: float = 1.0
    prior_return_tokens: float = 20.0
    prior_weight: float = 1.0
    name: str = "type-mean"
    _durations: dict[ApiType, _RunningMean] = field(default_factory=dict)
    _returns: dict[ApiType, _RunningMean] = field(default_factory=dict)

    def estimate(self, request: Request, segment_index: int) -> ApiEstimate:
        api = request.segments[segment_index].api
        if api is None:
            return ApiEstimate(0.0, 0)
        returns = self._returns.get(api.api_type)
        return ApiEstimate(
            self.duration_s(api.api_type),
            round(returns.mean) if returns else round(self.prior_return_tokens),
        )

    def duration_s(self, api_type: ApiType) -> float:
        """The current estimate of a call's duration for `api_type`."""
        duration = self._durations.get(api_type)
        return math.exp(duration.mean) if duration else self.prior_duration_s

    def declare(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        """A tool's stated expectation: the prior for its type, until calls of that type are observed."""
        if api_type not in self._durations:
            self._durations[api_type] = _RunningMean(math.log(max(duration_s, SHORTEST_S)) * self.prior_weight,
                                                     self.prior_weight)
            self._returns[api_type] = _RunningMean(return_tokens * self.prior_weight, self.prior_weight)

    def observe(self, api_type: ApiType, duration_s: float, return_tokens: int) -> None:
        duration = self._durations.setdefault(
            api_type, _RunningMean(math.log(self.prior_duration_s) * self.prior_weight, self.prior_weight)
        )
        duration.total += math.log(max(duration_s, SHORTEST_S))
        duration.weight += 1
        returns = self._returns.setdefault(
            api_type, _RunningMean(self.prior_return_tokens * self.prior_weight, self.prior_weight)
        )
        returns.total += return_tokens
        returns.weight += 1


def parse_api_estimator(spec: str) -> ApiEstimator:
    if spec == "oracle":
        return OracleApi()
    if spec == "type-mean":
        return TypeMeanApi()
    if spec == "past-mean":
        from marsched.predict.online import PastMeanApi

        return PastMeanApi()
    raise ValueError(f"unknown API estimator {spec!r}; valid: past-mean, type-mean, oracle")
