"""Per-request information that travels with each input chunk to the scheduler.

It rides in `SamplingParams.extra_args["marsched"]`, which vLLM carries unchanged
into the scheduler's `Request.sampling_params` (every chunk of a resumable request
replaces the request's sampling params, so each chunk carries the current plan):

    {"segment": 1,                        # index of the segment this chunk starts
     "plan": [[out_tokens, api_type, api_s, return_tokens], ..., [out_tokens, null, 0, 0]],
     "strategy": "swap",                  # optional per-request override
     "rid": "req-7"}                      # the caller's request id, for the trace

`plan` is the caller's expectation of the whole request: for trace replay the true
trace request, for live tool use the expected output tokens per segment and, per
call, the tool's API type, expected duration and return length. The scheduler
builds a `marsched.workload.Request` from it; the configured predictor predicts
from that request (the oracle predictor takes it as the truth).

Requests without this entry (plain clients of `vllm serve`) are taken as one
segment of `max_tokens` tokens.

This module does not import vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marsched.policy import Strategy
from marsched.workload.model import ApiCall, ApiType, Request, build_request

KEY = "marsched"


@dataclass(frozen=True, slots=True)
class PlannedSegment:
    output_tokens: int
    api_type: ApiType | None = None  # None: the last segment
    api_s: float = 0.0
    return_tokens: int = 0

    def to_list(self) -> list[Any]:
        return [self.output_tokens, self.api_type.value if self.api_type else None, self.api_s, self.return_tokens]

    @classmethod
    def from_list(cls, item: list[Any]) -> "PlannedSegment":
        out, api, api_s, ret = item
        return cls(int(out), ApiType(api) if api is not None else None, float(api_s), int(ret))


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    segment: int
    plan: tuple[PlannedSegment, ...]
    strategy: Strategy | None = None
    request_id: str | None = None  # the caller's id (vLLM's internal id adds a random suffix)

    def to_extra_args(self) -> dict[str, Any]:
        data: dict[str, Any] = {"segment": self.segment, "plan": [p.to_list() for p in self.plan]}
        if self.strategy is not None:
            data["strategy"] = self.strategy.value
        if self.request_id is not None:
            data["rid"] = self.request_id
        return {KEY: data}


def decode(sampling_params: Any) -> ChunkMeta | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    data = extra.get(KEY)
    if not data:
        return None
    strategy = data.get("strategy")
    return ChunkMeta(
        int(data.get("segment", 0)),
        tuple(PlannedSegment.from_list(p) for p in data.get("plan", ())),
        Strategy(strategy) if strategy else None,
        data.get("rid"),
    )


def workload_request(request_id: str, prompt_tokens: int, plan: tuple[PlannedSegment, ...], arrival_s: float) -> Request:
    """The workload-model request the policy predicts from; the last segment never has a call."""
    if not plan:
        plan = (PlannedSegment(1),)
    parts = []
    for index, seg in enumerate(plan):
        last = index == len(plan) - 1
        api = None if last or seg.api_type is None else ApiCall(seg.api_type, seg.api_s, seg.return_tokens)
        if not last and api is None:  # a segment inside the plan must end with a call
            api = ApiCall(ApiType.OTHER, seg.api_s, seg.return_tokens)
        parts.append((max(seg.output_tokens, 1), api))
    return build_request(request_id, max(prompt_tokens, 1), parts, arrival_s)
