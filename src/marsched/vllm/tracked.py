"""The plugin's per-request state: what `MarsScheduler` knows of a vLLM request beyond vLLM's own.

`Tracked` is the lifecycle driver's `CallHandle` for vLLM (`marsched.lifecycle`): the request's
progress as the policy sees it, where its KV is during a call (`Kv`), and the client-side facts
(plan, conversation) its metadata carried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from marsched.policy import RequestProgress, Strategy
from marsched.policy.retention import GapSource
from marsched.predict import SegmentPrediction
from marsched.vllm.metadata import PlannedSegment


class Kv:
    """Where a paused request's KV cache is."""

    DEVICE = "device"
    DISCARDED = "discarded"
    SWAP_QUEUED = "swap-queued"  # copy asked for, not yet sent to the worker
    SWAP_OUT = "swap-out"  # copy sent with this step; blocks freed when the step's output arrives
    HOST = "host"


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """What a finished conversation turn's KV got between its turns, and from which predicted gap."""

    strategy: Strategy
    gap_s: float  # the predicted gap the decision saw (the `policy` rule decides from it)
    source: GapSource
    tools: tuple[str, ...] = ()  # the tools whose estimate gave `gap_s`
    redecided: bool = False  # decided again once the API server told the turn's tools

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.value, "gap_s": self.gap_s, "gap_source": self.source.value,
                "tools": list(self.tools), "redecided": self.redecided}


@dataclass(eq=False)
class Tracked:
    progress: RequestProgress
    rid: str  # the caller's id, for the trace
    prompt_tokens: int
    plan: tuple[PlannedSegment, ...]
    arrival_t: float
    wait_since_s: float  # when it last entered the waiting queue (time.monotonic)
    override: Strategy | None = None  # the strategy the request asked for (`allow_request_strategy`)
    kv: str = Kv.DEVICE
    in_call: bool = False
    paused_t: float | None = None
    saved_tokens: int = 0
    first_token_t: float = math.nan
    restore_skip_prefix: bool | None = None
    closing: bool = False
    preemptions: int = 0
    max_wait_s: float = 0.0
    victim_key: float = 0.0
    conversation: str | None = None  # the conversation this request is a turn of
    inferred: bool = False  # the conversation was recognised from the prompt, not named (`follow_ups.py`)
    prompt_blocks: int = 0  # full blocks of its prompt hashed at arrival (an inferred turn's)
    tool_s: float | None = None  # the client's estimate of the time until the next turn
    retain: bool = True
    retention: RetentionDecision | None = None  # a finished conversation turn's, once decided
    strategies: list[str] = field(default_factory=list)  # the strategy each call ran under
    predictions: dict[int, SegmentPrediction] = field(default_factory=dict)  # at each segment's start
    front_end_predictions: set[int] = field(default_factory=set)  # segments whose length the front end predicted
