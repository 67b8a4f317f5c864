"""Each segment's strategy follows the policy's rule (docs/policies.md; docs/audit.md, "The checks").

- `ahead` (MARS, SJF) and `fixed`: assigned before the segment's first token and never changed
  afterwards: not on preemption, not on re-queueing, not when the call returns. The one change
  allowed is the engine's `host-full` fallback (a swap with no host room left at the call).
- `at-call` (INFERCEPT): assigned at the call, from the actual context, never ahead of it; while
  preserved, it may be `reconsidered` to a cheaper strategy.
- `end-at-call` (stock vLLM): every call discards.
- `budgeted` (INFERCEPT's code): preserved at the call; during it `reconsidered` to a discard or a
  swap, and a swap to a discard when the host needs room.
Every call runs under the segment's (last) assigned strategy, and a preempted request keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marsched.audit.declared import Declared
from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation
from marsched.policy.policy import StrategyRule

_FIRST_REASONS = {
    StrategyRule.AHEAD: {"ahead", "request"},
    StrategyRule.FIXED: {"fixed", "request"},
    StrategyRule.AT_CALL: {"at-call", "request"},
    StrategyRule.END_AT_CALL: {"fixed"},
    StrategyRule.BUDGETED: {"at-call", "request"},
    StrategyRule.TTL: {"ttl"},
}
_AT_CALL_RULES = (StrategyRule.AT_CALL, StrategyRule.BUDGETED)  # decided when the call starts


@dataclass(slots=True)
class _Segment:
    index: int = 0
    assigned: list[Line] = field(default_factory=list)
    started: Line | None = None  # the event from which the segment's tokens are computed
    preempted: Line | None = None  # the last preemption after the first assignment
    in_call: Line | None = None
    returned: bool = False  # the call has returned (the next segment has not started yet)


class StrategyRules:
    def __init__(self, report, declared: Declared) -> None:
        self.report = report
        self.rule = declared.rule
        self.fixed = declared.fixed.value if declared.fixed else None
        self.policy = declared.policy
        self.segments: dict[str, _Segment] = {}

    def _segment(self, event: dict) -> _Segment:
        state = self.segments.get(event["rid"])
        if state is None or event["segment"] > state.index:
            state = self.segments[event["rid"]] = _Segment(event["segment"])
        return state

    def _violation(self, line: Line, message: str, *others: Line | None) -> None:
        e = line.event
        lines = (line.number, *(o.number for o in others if o is not None))
        self.report(Violation(Check.STRATEGY, e["rid"], e["t"], f"segment {e['segment']}: {message}", lines))

    def on_assign_strategy(self, line: Line) -> None:
        e = line.event
        state = self._segment(e)
        strategy, reason = e["strategy"], e["reason"]
        if not state.assigned:
            if reason not in _FIRST_REASONS[self.rule]:
                self._violation(line, f"strategy assigned with reason '{reason}', but {self.policy} assigns "
                                      f"{self._how()}", state.started)
            elif self.rule in (StrategyRule.AHEAD, StrategyRule.FIXED) and state.started is not None:
                self._violation(line, f"{strategy} assigned at t={e['t']:.6g}s, after the segment started running "
                                      f"at t={state.started.event['t']:.6g}s: {self.policy} fixes it before the "
                                      "segment's first token", state.started)
            elif self.rule in _AT_CALL_RULES and reason == "at-call" and state.started is None:
                self._violation(line, "assigned before the segment ran: INFERCEPT decides at the call")
            if self.fixed is not None and strategy != self.fixed and reason != "request":
                self._violation(line, f"{strategy} assigned, but {self.policy} always uses {self.fixed}")
            if self.rule is StrategyRule.END_AT_CALL and strategy != "discard":
                self._violation(line, f"{strategy} assigned, but stock vLLM ends the request at its call (discard)")
            state.assigned.append(line)
            return
        first, last = state.assigned[0], state.assigned[-1]
        before = last.event["strategy"]
        if reason == "host-full" and before == "swap" and strategy != "swap":
            pass  # the engine's fallback when host memory is full at the call
        elif (reason == "reconsidered" and self.rule is StrategyRule.AT_CALL and state.in_call is not None
              and before == "preserve"):
            pass  # INFERCEPT revisits a preserved call
        elif (reason in ("ttl-expired", "pressure") and self.rule is StrategyRule.TTL and state.in_call is not None
              and (before, strategy) == ("preserve", "discard")):
            pass  # Continuum gives up a pin when its time-to-live ends or memory runs short
        elif (reason == "reconsidered" and self.rule is StrategyRule.BUDGETED and state.in_call is not None
              and (before == "preserve" or (before, strategy) == ("swap", "discard"))):
            pass  # INFERCEPT's code discards or swaps out a preserved call, or drops a swapped one for host room
        else:
            when = ("during its call" if state.in_call else "after its call returned" if state.returned
                    else "after a preemption" if state.preempted else "before its call")
            self._violation(line, f"strategy changed from {before} (assigned at t={first.event['t']:.6g}s, "
                                  f"{first.event['reason']}) to {strategy} ({reason}) {when}; "
                                  f"{self.policy} never changes a segment's strategy once assigned"
                                  + (" except by reconsidering a preserved call" if self.rule in _AT_CALL_RULES
                                     else ""), first, state.preempted)
        state.assigned.append(line)

    def _how(self) -> str:
        return {StrategyRule.AHEAD: "ahead of the segment, from predictions ('ahead')",
                StrategyRule.FIXED: "one fixed strategy ('fixed')",
                StrategyRule.AT_CALL: "at the call ('at-call')",
                StrategyRule.END_AT_CALL: "discard at every call ('fixed')",
                StrategyRule.BUDGETED: "preserve at the call ('at-call')",
                StrategyRule.TTL: "a pin for a time-to-live at the call ('ttl')"}[self.rule]

    def on_admit(self, line: Line) -> None:
        state = self._segment(line.event)
        if state.started is None:
            state.started = line

    def on_resume(self, line: Line) -> None:
        state = self._segment(line.event)
        if line.event["where"] == "device" and state.started is None:
            state.started = line  # the preserved request runs on at once

    def on_preempt(self, line: Line) -> None:
        e = line.event
        state = self._segment(e)
        if state.assigned:
            state.preempted = line
            kept = state.assigned[-1].event["strategy"]
            if e["strategy"] != kept:
                self._violation(line, f"preempted with strategy {e['strategy']}, but the segment was assigned "
                                      f"{kept}: a preempted request keeps its strategy", state.assigned[-1])

    def on_api_start(self, line: Line) -> None:
        e = line.event
        state = self._segment(e)
        state.in_call = line
        if e["strategy"] is None:
            return  # a trailing call: the request's KV is freed, nothing to decide
        if not state.assigned:
            self._violation(line, f"the call started under {e['strategy']} with no strategy assigned to the segment")
            return
        last = state.assigned[-1]
        if last.event["strategy"] != e["strategy"]:
            self._violation(line, f"the call ran under {e['strategy']}, but the segment was assigned "
                                  f"{last.event['strategy']} at t={last.event['t']:.6g}s", last)

    def on_api_end(self, line: Line) -> None:
        state = self._segment(line.event)
        state.in_call = None
        state.returned = True
