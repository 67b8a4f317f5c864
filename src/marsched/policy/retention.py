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

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from marsched.policy.load import EngineLoad
from marsched.policy.policy import Policy
from marsched.policy.strategy import Strategy
from marsched.predict.api_duration import SHORTEST_S, TypeMeanApi
from marsched.workload.model import ApiType

DEFAULT_LIMIT_S = 60.0
# k of `shrunk_gap_s`: the global estimate counts as one of a tool's own gaps, as a type's prior
# does in `TypeMeanApi`. Gaps of one tool spread less than gaps of different tools (a calculator's
# milliseconds, a human's minutes), so a tool's own gaps should take over fast: after n of them
# they weigh n / (n + 1).
TOOL_PRIOR_WEIGHT = 1.0
MAX_TOOLS = 256  # tools whose gaps are tracked; the least recently observed is dropped


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
class ToolGaps:
    """The gaps observed after one tool's calls, in log space (their geometric mean)."""

    samples: int = 0
    log_sum: float = 0.0

    def observe(self, gap_s: float) -> None:
        self.samples += 1
        self.log_sum += math.log(max(gap_s, SHORTEST_S))


def shrunk_gap_s(tool: ToolGaps, prior_s: float, prior_weight: float = TOOL_PRIOR_WEIGHT) -> float:
    """A tool's gap estimate: the geometric mean of its own `tool.samples` gaps, shrunk toward
    `prior_s` (the estimate over all tools) as if the prior were `prior_weight` more samples.

        estimate = exp((log_sum + k · ln prior_s) / (n + k)),  k = prior_weight, n = samples

    In log space the weight of the tool's own mean is n / (n + k): its first gap counts half
    (k = 1), its ninth nine tenths. With no samples the estimate is the prior."""
    return math.exp((tool.log_sum + prior_weight * math.log(max(prior_s, SHORTEST_S))) / (tool.samples + prior_weight))


@dataclass(slots=True)
class GapEstimator:
    """The predicted time from a turn's end to its follow-up, per tool the turn calls.

    - the client's `tool_s`, when it gives one;
    - else, for a turn known to call tools, the largest of their estimates (calls made in
      parallel: the follow-up waits for the slowest); a tool's estimate is its own geometric
      mean shrunk toward the global one (`shrunk_gap_s`);
    - else the global estimate: the geometric mean of every gap observed (from a 1 s prior).

    A gap is observed into the global mean, and into the tool it is attributed to: of several
    tools, the one with the largest estimate (the others' times hide inside the gap; it says
    only that they took no longer). At most `max_tools` tools are tracked; the one least
    recently observed goes first, so clients naming ever new tools cannot grow the memory.
    """

    max_tools: int = MAX_TOOLS
    _means: TypeMeanApi = field(default_factory=TypeMeanApi)
    _tools: OrderedDict[str, ToolGaps] = field(default_factory=OrderedDict)
    _shown: dict[str, dict[str, float]] | None = None  # `snapshot`, until the next observation

    @property
    def global_s(self) -> float:
        return self._means.duration_s(ApiType.TOOL)

    def tool_s(self, name: str) -> float:
        """A tool's estimate (the global one for a tool never observed)."""
        tool = self._tools.get(name)
        return self.global_s if tool is None else shrunk_gap_s(tool, self.global_s)

    def predict(self, stated_s: float | None, tools: tuple[str, ...] = ()) -> float:
        if stated_s is not None:
            return stated_s
        if tools:
            return max(self.tool_s(name) for name in tools)
        return self.global_s

    def observe(self, gap_s: float, tools: tuple[str, ...] = ()) -> None:
        if tools:
            name = max(tools, key=self.tool_s)  # before the global mean moves
            tool = self._tools.pop(name, None) or ToolGaps()
            tool.observe(gap_s)
            self._tools[name] = tool  # the most recently observed last
            while len(self._tools) > self.max_tools:
                self._tools.popitem(last=False)
        self._means.observe(ApiType.TOOL, gap_s, 0)
        self._shown = None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Tool name -> {"samples", "estimate_s"} (`/marsched/state`)."""
        if self._shown is None:
            prior_s = self.global_s
            self._shown = {name: {"samples": tool.samples, "estimate_s": shrunk_gap_s(tool, prior_s)}
                           for name, tool in self._tools.items()}
        return self._shown


class GapSource(str, Enum):
    """Where a turn's predicted gap came from (`/marsched/state?request_id=`)."""

    STATED = "tool_s"  # the client's own estimate: it wins
    HINT = "hint"  # the tools the turn's reply called, told by the API server after the reply
    PREVIOUS = "previous-tool"  # the conversation's previous tool, until the hint arrives
    GLOBAL = "global"  # no tool known: every tool's gaps together
