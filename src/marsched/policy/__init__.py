"""Scheduling policy: costs, waste per strategy, strategy choice, ranking, starvation, named policies."""

from marsched.policy.admission import Admission, KvOutlook
from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.policy import Order, Policy, StarvationConfig, StrategyRule
from marsched.policy.progress import RequestProgress, StrategyAssignment
from marsched.policy.queue import WaitingQueue
from marsched.policy.ranking import RankingTerms
from marsched.policy.registry import (
    POLICY_NAMES, STARVATION_NAMES, STARVATION_VARIANTS, make_policy, parse_threshold,
)
from marsched.policy.strategy import Strategy
from marsched.policy.waste import Wastes, call_wastes, cheapest

__all__ = [
    "POLICY_NAMES",
    "STARVATION_NAMES",
    "STARVATION_VARIANTS",
    "Admission",
    "CostModel",
    "EngineLoad",
    "KvOutlook",
    "Order",
    "Policy",
    "RankingTerms",
    "RequestProgress",
    "StarvationConfig",
    "Strategy",
    "StrategyAssignment",
    "StrategyRule",
    "WaitingQueue",
    "Wastes",
    "call_wastes",
    "cheapest",
    "make_policy",
    "parse_threshold",
]
