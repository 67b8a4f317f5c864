"""What a trace's `run` event declares: the engine, the policy's rules and the capacities.

The order and the strategy rule come from the policy the trace is audited as (`--policy`,
by default the one it declares); the starvation rule is always the declared one, so that a
run is held to the variant it ran under, a redesign included.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsched.audit.reader import Line, TraceReadError
from marsched.audit.keys import RECOMPUTED, key_policy
from marsched.policy.policy import Order, Policy, Protection, StarvationClock, StarvationCount, StrategyRule
from marsched.policy.registry import named_rules
from marsched.policy.strategy import Strategy


@dataclass(frozen=True, slots=True)
class Starvation:
    threshold: float | None  # None: off
    clock: StarvationClock
    counts: StarvationCount
    for_life: bool
    variant: str
    fcfs_multiple: float | None = None  # the threshold moves with the FCFS wait; events report it
    protection: Protection = Protection.QUANTUM  # how long an admitted promoted request is not preempted
    quantum: int = 0  # under quantum protection: iterations from the admission
    # The threshold is per iteration of each request's service (Autellix), which the trace does
    # not carry: the threshold is then a floor, and an unpromoted request past it is not starved.
    per_service: bool = False

    @property
    def moves(self) -> bool:
        return self.enabled and self.fcfs_multiple is not None

    @property
    def enabled(self) -> bool:
        return self.threshold is not None


@dataclass(frozen=True, slots=True)
class Declared:
    engine: str
    declared_policy: str  # as the trace says
    policy: str  # as audited
    order: Order
    rule: StrategyRule
    fixed: Strategy | None
    starvation: Starvation
    device_blocks: int
    host_blocks: int
    key_policy: Policy | None  # recomputes ranking keys; None: the order's keys are times, or no cost model

    @property
    def order_checked(self) -> bool:
        """INFERCEPT's code admits from two queues in passes and lets a request that can take its
        blocks pass one that cannot, which the trace does not record: its order is not checked."""
        return self.rule is not StrategyRule.BUDGETED


def declared(path: str, run: Line, policy: str | None) -> Declared:
    """Read the `run` event; `policy` (a named policy) overrides the declared order and rule."""
    event = run.event
    try:
        p = event["policy"]
        s = p["starvation"]
        starvation = Starvation(s["threshold"], StarvationClock(s["clock"]), StarvationCount(s["counts"]),
                                bool(s["for_life"]), str(s.get("variant", "custom")),
                                float(s["fcfs_multiple"]) if s.get("fcfs_multiple") is not None else None,
                                Protection(s["protection"]), int(s["quantum"]), bool(s.get("per_service", False)))
        if policy is None:
            order, rule = Order(p["order"]), StrategyRule(p["rule"])
            fixed = Strategy(p["fixed_strategy"]) if p["fixed_strategy"] else None
        else:
            order, rule, fixed = named_rules(policy)
        name = policy or str(p["name"])
        keys = key_policy(name, p) if order in RECOMPUTED else None
        return Declared(str(event["engine"]), str(p["name"]), name, order, rule, fixed,
                        starvation, int(event["device_blocks"]), int(event["host_blocks"]), keys)
    except (KeyError, TypeError, ValueError) as error:
        raise TraceReadError(path, run.number, f"run event: policy declaration unreadable ({error})") from None
