"""One prediction per segment: output length, call duration and return length together."""

from __future__ import annotations

from dataclasses import dataclass

from marsched.predict.api_duration import ApiEstimator, OracleApi
from marsched.predict.length import LengthPredictor, OracleLength
from marsched.workload.model import ApiCall, Request
from marsched.workload.past import RequestPast


@dataclass(slots=True)  # not frozen: built for every later segment at every segment start
class SegmentPrediction:
    output_tokens: int
    api_duration_s: float  # 0 for the last segment
    api_return_tokens: int
    has_call: bool
    # The prefix of the context at the call that the next segment keeps (`ApiCall.kept_tokens`;
    # None: all of it). Taken from the plan, as the client records its compaction: no estimator
    # predicts compaction yet.
    kept_tokens: int | None = None


@dataclass(slots=True)
class SegmentPredictor:
    length: LengthPredictor
    api: ApiEstimator

    @classmethod
    def oracle(cls) -> "SegmentPredictor":
        return cls(OracleLength(), OracleApi())

    @property
    def name(self) -> str:
        return f"{self.length.name}+api:{self.api.name}"

    @property
    def knowable(self) -> bool:
        """Whether both parts predict from the past alone (`workload/past.py`); the others read
        the segment's own length or call from the trace, and are bounds."""
        return getattr(self.length, "knowable", False) and getattr(self.api, "knowable", False)

    def predict(self, request: Request, segment_index: int) -> SegmentPrediction:
        if self.knowable:
            return self.predict_past(RequestPast.of(request, segment_index))
        segment = request.segments[segment_index]
        api = self.api.estimate(request, segment_index)
        return SegmentPrediction(
            self.length.predict(request, segment_index),
            api.duration_s,
            api.return_tokens,
            segment.api is not None,
            segment.api.kept_tokens if segment.api is not None else None,
        )

    def predict_past(self, past: RequestPast) -> SegmentPrediction:
        """From the past alone: whether the segment ends with a call is not known, so it is
        predicted to (the policy weighs that by its program outlook), and keeps its context."""
        api = self.api.estimate_past(past)
        return SegmentPrediction(self.length.predict_past(past), api.duration_s, api.return_tokens, True, None)

    def observe_output(self, past: RequestPast, output_tokens: int) -> None:
        """A segment ended after `output_tokens` (a predictor that learns online takes it)."""
        observe = getattr(self.length, "observe_output", None)
        if observe is not None:
            observe(past, output_tokens)

    def observe(self, call: ApiCall) -> None:
        self.api.observe(call.api_type, call.duration_s, call.return_tokens)
