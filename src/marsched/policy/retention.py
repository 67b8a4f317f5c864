"""Keeping a conversation's KV cache between its turns: the rule, the gap estimate, the choice.

A conversation turn that ends with a tool call is an API call seen from the server's side:
the client runs the tool and comes back with its result in a new request that starts with
the same context. What to do with the context meanwhile is the strategy of a call
(Preserve, Swap, Discard), decided from the context and the predicted gap until the
follow-up, as for any call (`Policy.strategy_for_gap`).

Rules (`MarsConfig.retention`, `marsched serve --retention`):
- `policy` (default): the policy decides. MARS and INFERCEPT take the cheapest strategy by
  INFERCEPT's waste formulas; stock vLLM (`vllm`) discards; a fixed-strategy policy keeps
  its strategy.
- `fixed:SECONDS`: every conversation's KV stays on the device for SECONDS, whatever its
  size or gap (the Continuum approach: time-to-live pinning).
- `off`: nothing is kept (stock vLLM: the blocks go back to the prefix cache).

Whatever the rule, a retention ends when the follow-up arrives, when the conversation is
released, or at the time limit.

This module does not import vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from marsched.policy.load import EngineLoad
from marsched.policy.policy import Policy
from marsched.policy.strategy import Strategy
from marsched.predict.api_duration import TypeMeanApi
from marsched.workload.model import ApiType

DEFAULT_LIMIT_S = 60.0


class RetentionMode(str, Enum):
    POLICY = "policy"
    FIXED = "fixed"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class RetentionRule:
    mode: RetentionMode = RetentionMode.POLICY
    fixed_s: float = 0.0  # FIXED: how long every conversation's KV is kept
    limit_s: float = DEFAULT_LIMIT_S  # no retention outlives this

    def __post_init__(self) -> None:
        if not self.limit_s > 0:
            raise ValueError(f"retention limit must be > 0 s, got {self.limit_s}")
        if self.mode is RetentionMode.FIXED and not 0 < self.fixed_s:
            raise ValueError(f"fixed retention needs a time > 0 s, got {self.fixed_s}")

    @property
    def name(self) -> str:
        return f"fixed:{self.fixed_s:g}" if self.mode is RetentionMode.FIXED else self.mode.value

    def decide(self, policy: Policy, context_tokens: int, gap_s: float, load: EngineLoad) -> "RetentionChoice":
        """What to do with a finished turn's `context_tokens` until its follow-up, predicted in `gap_s`."""
        if self.mode is RetentionMode.OFF:
            return RetentionChoice(Strategy.DISCARD, 0.0)
        if self.mode is RetentionMode.FIXED:
            return RetentionChoice(Strategy.PRESERVE, min(self.fixed_s, self.limit_s))
        strategy = policy.strategy_for_gap(context_tokens, gap_s, load)
        return RetentionChoice(strategy, 0.0 if strategy is Strategy.DISCARD else self.limit_s)


@dataclass(frozen=True, slots=True)
class RetentionChoice:
    strategy: Strategy
    hold_s: float  # how long the KV is kept at most (0: not kept)


def parse_retention(spec: str, limit_s: float = DEFAULT_LIMIT_S) -> RetentionRule:
    """`policy`, `off` or `fixed:SECONDS`; ValueError naming what is wrong."""
    text = str(spec).strip()
    if text in (RetentionMode.POLICY.value, RetentionMode.OFF.value):
        return RetentionRule(RetentionMode(text), limit_s=limit_s)
    name, _, value = text.partition(":")
    if name == RetentionMode.FIXED.value and value:
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise ValueError(f"retention {spec!r}: fixed:SECONDS needs a number of seconds > 0")
        return RetentionRule(RetentionMode.FIXED, seconds, limit_s)
    raise ValueError(f"retention {spec!r}: give policy, off or fixed:SECONDS")


@dataclass(slots=True)
class GapEstimator:
    """The predicted time from a turn's end to its follow-up: the client's `tool_s` when it gives
    one, otherwise the geometric mean of the gaps observed so far (from a 1 s prior)."""

    _means: TypeMeanApi = field(default_factory=TypeMeanApi)

    def predict(self, stated_s: float | None) -> float:
        return stated_s if stated_s is not None else self._means.duration_s(ApiType.TOOL)

    def observe(self, gap_s: float) -> None:
        self._means.observe(ApiType.TOOL, gap_s, 0)
