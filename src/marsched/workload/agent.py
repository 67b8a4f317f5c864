"""Synthetic long-context agent requests: a large prompt, a handful of tool calls, a growing context.

This is the memory-bound regime the INFERCEPT mixture does not reach (its contexts stay
near 2k tokens): an agent starts from a prompt of a few thousand tokens (system prompt,
tool schemas, task), and each tool call appends a few hundred tokens of results, so a
request holds 5k to 12k tokens of KV cache while it waits on tools for seconds at a time.
Whether to keep, drop or move that cache during a call is then the whole question.

Shape of one request (all draws from one `numpy.random.default_rng(seed)` stream):

- prompt: lognormal, median `prompt_median` (3000) tokens, log-sd `prompt_sigma` (0.35),
  clipped to `prompt_tokens` (1000 to 6000);
- a target number of tool calls, uniform on `calls` (2 to 10, inclusive);
- a final answer: lognormal, median `answer_median` (300), log-sd 0.5, clipped to
  `answer_tokens` (50 to 1000). It is drawn before the calls so that room is kept for it;
- per call, in order: the tool-call message the model writes before it, uniform on
  `call_tokens` (20 to 200: a JSON call); the tool's duration, lognormal, median
  `tool_median_s` (1.5 s), log-sd 1.0, clipped to `tool_duration_s` (0.1 s to 20 s) and
  rounded to the millisecond; its result, lognormal, median `result_median` (300), log-sd
  0.8, clipped to `result_tokens` (20 to 2000).

A call is added only if the context after it, plus the final answer, stays within
`max_context_tokens` (12,000); the first call that would not fit ends the request's calls
(later ones are not tried). With the defaults the first two calls always fit (6000 + 2 ×
(200 + 2000) + 1000 = 11,400), so every request has 2 to 10 calls and a final context of at
most 12,000 tokens, well inside the simulator's GPT-J profiles. Lognormal draws are rounded
to whole tokens after clipping. Requests are ``agent-0`` … ``agent-{n-1}``, all arriving at 0
(arrival processes sample them later); calls are `ApiType.TOOL`; no request ends with a call.

The bundled sample (the named trace ``agent``) is `agent_requests(BUNDLED_COUNT,
seed=BUNDLED_SEED)` written with `save_jsonl`; ``scripts/make_agent_trace.py`` rewrites it
and docs/workloads.md gives its summary statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from marsched.workload.model import ApiCall, ApiType, Request, build_request

BUNDLED_SEED = 0
BUNDLED_COUNT = 400


@dataclass(frozen=True, slots=True)
class AgentWorkloadParams:
    """The distributions of `agent_requests`; ranges are inclusive clips, medians and log-sds define lognormals."""

    prompt_median: float = 3000.0
    prompt_sigma: float = 0.35
    prompt_tokens: tuple[int, int] = (1000, 6000)
    calls: tuple[int, int] = (2, 10)
    call_tokens: tuple[int, int] = (20, 200)
    tool_median_s: float = 1.5
    tool_sigma: float = 1.0
    tool_duration_s: tuple[float, float] = (0.1, 20.0)
    result_median: float = 300.0
    result_sigma: float = 0.8
    result_tokens: tuple[int, int] = (20, 2000)
    answer_median: float = 300.0
    answer_sigma: float = 0.5
    answer_tokens: tuple[int, int] = (50, 1000)
    max_context_tokens: int = 12_000

    def __post_init__(self) -> None:
        for name in ("prompt_median", "tool_median_s", "result_median", "answer_median"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"AgentWorkloadParams.{name} must be a finite number > 0, got {value!r}")
        for name in ("prompt_sigma", "tool_sigma", "result_sigma", "answer_sigma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"AgentWorkloadParams.{name} must be a finite number >= 0, got {value!r}")
        for name in ("prompt_tokens", "calls", "call_tokens", "result_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high):
                raise ValueError(f"AgentWorkloadParams.{name} must be integers 0 <= low <= high, got {(low, high)!r}")
        low, high = self.tool_duration_s
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
            raise ValueError(f"AgentWorkloadParams.tool_duration_s must be 0 <= low <= high, got {(low, high)!r}")
        # The longest prompt and answer must fit, or no request could be built within the cap.
        if self.prompt_tokens[1] + self.answer_tokens[1] > self.max_context_tokens:
            raise ValueError(
                f"AgentWorkloadParams.max_context_tokens ({self.max_context_tokens}) is below the longest prompt "
                f"plus the longest answer ({self.prompt_tokens[1]} + {self.answer_tokens[1]})"
            )


def agent_requests(n: int, *, seed: int, params: AgentWorkloadParams = AgentWorkloadParams()) -> list[Request]:
    """`n` agent requests (see the module docstring); the same seed and params give the same requests."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"agent_requests: n must be an integer >= 0, got {n!r}")
    rng = np.random.default_rng(seed)
    return [_request(f"agent-{index}", rng, params) for index in range(n)]


def _request(request_id: str, rng: np.random.Generator, p: AgentWorkloadParams) -> Request:
    prompt = _lognormal_tokens(rng, p.prompt_median, p.prompt_sigma, p.prompt_tokens)
    target_calls = int(rng.integers(p.calls[0], p.calls[1], endpoint=True))
    answer = _lognormal_tokens(rng, p.answer_median, p.answer_sigma, p.answer_tokens)
    context = prompt
    parts: list[tuple[int, ApiCall | None]] = []
    for _ in range(target_calls):
        call = int(rng.integers(p.call_tokens[0], p.call_tokens[1], endpoint=True))
        duration = float(np.clip(rng.lognormal(math.log(p.tool_median_s), p.tool_sigma), *p.tool_duration_s))
        result = _lognormal_tokens(rng, p.result_median, p.result_sigma, p.result_tokens)
        if context + call + result + answer > p.max_context_tokens:
            break  # the context is full: the agent answers with what it has
        parts.append((call, ApiCall(ApiType.TOOL, round(duration, 3), result)))
        context += call + result
    parts.append((answer, None))
    return build_request(request_id, prompt, parts)


def _lognormal_tokens(rng: np.random.Generator, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    return int(round(float(np.clip(rng.lognormal(math.log(median), sigma), *bounds))))
