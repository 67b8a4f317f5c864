"""Recomputing an admitted request's ranking key from the trace's own predictions.

The key is the policy's (`Policy.queue_key`, the same code the engines rank with), applied to
what the `admit` event's `key_basis` says it was computed from: the request's state, the
engine's load at that moment, and the predictions of its current and later segments. A
queue that ranked by arrival or by prompt size records a key these inputs do not give.
First-come-first-served keys are times, checked in `order.py`.
"""

from __future__ import annotations

from typing import Any

from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.policy import Order, Policy
from marsched.policy.program import ProgramOutlook
from marsched.policy.progress import RequestProgress
from marsched.policy.ranking import RankingTerms
from marsched.policy.registry import make_policy
from marsched.policy.strategy import Strategy
from marsched.predict.segment import SegmentPrediction
from marsched.workload.model import build_request

RECOMPUTED = (Order.MEMORY_TIME, Order.REMAINING_TOKENS)
_PLACEHOLDER = build_request("audit", 0, [(1, None)])  # the key reads progress and predictions only


def key_policy(name: str, declared_policy: dict[str, Any]) -> Policy | None:
    """The policy to recompute keys with, or None when the trace declares no cost model."""
    cost = declared_policy.get("cost")
    if cost is None:
        return None
    return make_policy(name, CostModel(**cost), terms=RankingTerms(**declared_policy.get("terms", {})))


def recompute_key(policy: Policy, basis: dict[str, Any]) -> float:
    if "cost" in basis:  # computed with a cost model other than the run's (a server learns its own)
        declared, policy.cost = policy.cost, CostModel(**basis["cost"])
        try:
            return _recompute_key(policy, basis)
        finally:
            policy.cost = declared
    return _recompute_key(policy, basis)


def _recompute_key(policy: Policy, basis: dict[str, Any]) -> float:
    predictions = [SegmentPrediction(int(o), float(a), int(r), bool(c), int(kept[0]) if kept else None)
                   for o, a, r, c, *kept in basis["predictions"]]
    progress = RequestProgress(
        _PLACEHOLDER, order_s=0.0, context_tokens=basis["context_tokens"], computed_tokens=basis["computed_tokens"],
        generated=basis["generated"], predictions=predictions,
        strategy=Strategy(basis["strategy"]) if basis["strategy"] else None,
        program=ProgramOutlook(*map(float, basis["program"])) if basis.get("program") else None,
    )
    load = EngineLoad(0.0, basis["running_kv_tokens"], basis["tau_s"], basis["host_free_tokens"])
    return policy.queue_key(progress, load)
