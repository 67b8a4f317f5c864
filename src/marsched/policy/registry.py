"""The named policies of DESIGN.md's baseline table."""

from __future__ import annotations


from marsched.policy.cost_model import CostModel
from marsched.policy.policy import Order, Policy, StarvationConfig, StrategyRule
from marsched.policy.ranking import RankingTerms
from marsched.policy.strategy import Strategy
from marsched.predict.segment import SegmentPredictor

# name -> (order, rule, fixed strategy, starvation prevention on by default)
_NAMED: dict[str, tuple[Order, StrategyRule, Strategy | None, bool]] = {
    "vllm": (Order.FCFS_REENTRY, StrategyRule.END_AT_CALL, None, False),
    "infercept": (Order.FCFS, StrategyRule.AT_CALL, None, False),
    "sjf": (Order.REMAINING_TOKENS, StrategyRule.AHEAD, None, False),
    "preserve": (Order.FCFS, StrategyRule.FIXED, Strategy.PRESERVE, False),
    "discard": (Order.FCFS, StrategyRule.FIXED, Strategy.DISCARD, False),
    "swap": (Order.FCFS, StrategyRule.FIXED, Strategy.SWAP, False),
    "mars": (Order.MEMORY_TIME, StrategyRule.AHEAD, None, True),
}

POLICY_NAMES: tuple[str, ...] = tuple(_NAMED)

_DEFAULT = object()


def make_policy(
    name: str,
    cost: CostModel,
    predictor: SegmentPredictor | None = None,
    starvation_threshold: int | None | object = _DEFAULT,
    starvation_quantum: int = StarvationConfig().quantum,
    refresh_interval: int = 1,
    terms: RankingTerms | None = None,
) -> Policy:
    """Build a named policy. `starvation_threshold=None` turns prevention off; leaving it out
    takes the policy's default (on at 100 iterations for `mars`, off for the others)."""
    if name not in _NAMED:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    order, rule, fixed, starvation_on = _NAMED[name]
    if starvation_threshold is _DEFAULT:
        starvation_threshold = StarvationConfig().threshold if starvation_on else None
    return Policy(
        name=name,
        order=order,
        rule=rule,
        cost=cost,
        predictor=predictor or SegmentPredictor.oracle(),
        fixed_strategy=fixed,
        starvation=StarvationConfig(starvation_threshold, starvation_quantum),
        refresh_interval=refresh_interval,
        terms=terms or RankingTerms(),
    )


def parse_threshold(text: str) -> int | None:
    """`off` or a positive number of iterations."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"starvation threshold {text!r}: give a positive integer or 'off'") from None
    if value < 1:
        raise ValueError(f"starvation threshold {text!r}: give a positive integer or 'off'")
    return value


