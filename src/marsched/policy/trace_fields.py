"""The policy's part of the event trace: the rules a run declares, and what each queue key
was computed from. `marsched.audit` reads both back: it checks a run against the rules it
declares and recomputes each admitted request's key from these inputs with this policy code.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from marsched.policy.cost_model import CostModel
from marsched.policy.policy import Policy
from marsched.policy.program import ProgramOutlook
from marsched.policy.progress import RequestProgress
from marsched.policy.registry import starvation_variant


def declaration(policy: Policy) -> dict[str, Any]:
    """The `run` event's `policy`: order, strategy rule, starvation rule, cost model, ranking terms."""
    config = policy.starvation
    return {
        "name": policy.name,
        "order": policy.order.value,
        "rule": policy.rule.value,
        "fixed_strategy": policy.fixed_strategy.value if policy.fixed_strategy else None,
        "starvation": {
            "variant": starvation_variant(config),
            "threshold": config.threshold,
            "clock": config.clock.value,
            "counts": config.counts.value,
            "protection": config.protection.value,
            "quantum": config.quantum,
            "for_life": config.for_life,
            "fcfs_multiple": config.fcfs_multiple,
            "per_service": config.per_service,
        },
        "cost": asdict(policy.cost),
        "terms": asdict(policy.terms),
        "rest": policy.rest.value,
    }


def _program(outlook: ProgramOutlook) -> list[float]:
    fields = [outlook.turns_left, outlook.output_tokens, outlook.growth_tokens]
    if outlook.turns_left_sq is not None or outlook.completion != 1.0:
        fields += [outlook.turns_left ** 2 if outlook.turns_left_sq is None else outlook.turns_left_sq,
                   outlook.completion]
    return fields


def key_basis(progress: RequestProgress, declared: CostModel | None = None) -> dict[str, Any] | None:
    """The `admit` event's `key_basis`: the state, load and predictions its queue key came from, and
    the cost model where it is not the `declared` one (the run's: a server learns its own)."""
    basis = progress.key_basis
    if basis is None or not progress.predictions:
        return None
    cost = {} if basis.cost is None or declared is None or basis.cost == declared else {"cost": asdict(basis.cost)}
    return {
        **cost,
        "tau_s": basis.load.iteration_s,
        "running_kv_tokens": basis.load.running_kv_tokens,
        "host_free_tokens": basis.load.host_free_tokens,
        "context_tokens": basis.context_tokens,
        "computed_tokens": basis.computed_tokens,
        "generated": basis.generated,
        "strategy": basis.strategy.value if basis.strategy else None,
        # The current segment's and the later ones': [output tokens, call s, return tokens, has call],
        # and the tokens its call keeps where it compacts the context.
        "predictions": [[p.output_tokens, p.api_duration_s, p.api_return_tokens, p.has_call]
                        + ([] if p.kept_tokens is None else [p.kept_tokens])
                        for p in progress.predictions[basis.segment_index:]],
        # The rest of its program, learnt (a conversation's turns, or a request's segments):
        # [turns left, reply tokens, growth tokens], and for a Gittins rank E[turns²] and the
        # chance it ends by the horizon.
        **({} if progress.program is None else {"program": _program(progress.program)}),
    }
