"""Each live configuration's twin in the simulator: the policy that decides as that server decides,
knowing what it knows.

Every simulated policy predicts from the past only (`--predictor online`, `--api-estimator
past-mean`, the rest of a program by the Gittins rank: the simulator's knowable defaults), as
the live servers do. INFERCEPT's decision at a call prices the call by its predicted duration, as
the live server must (`Policy.reads_true_call_time` off; elsewhere the simulator keeps its
source's rule, the true duration).

- `vllm-stock`, `vllm`: stock vLLM's order, each turn ending its request, the prefix cache
  keeping freed blocks (`vllm`);
- `vllm-stock-host`: the same with a host tier for evicted prefix blocks (`vllm-offload`);
- `infercept`, `autellix`, `mars`: the policy of that name;
- `continuum`: `marsched serve --policy mars --retention fixed:T`, so MARS's order with every
  call's KV pinned for T seconds (`policy.ttl.ConstantTtl`).
"""

from __future__ import annotations

from dataclasses import replace

from marsched.policy.cost_model import CostModel
from marsched.policy.policy import Policy, StrategyRule
from marsched.policy.registry import make_policy
from marsched.policy.ttl import ConstantTtl
from marsched.predict import SegmentPredictor, parse_api_estimator, parse_length_predictor
from marsched.predict.online import DEFAULT_API_ESTIMATOR, DEFAULT_PREDICTOR

SIM_POLICY = {
    "vllm-stock": "vllm",
    "vllm-stock-host": "vllm-offload",
    "vllm": "vllm",
    "infercept": "infercept",
    "continuum": "mars",
    "autellix": "autellix",
    "mars": "mars",
}


def twin_policy(config: str, cost: CostModel, pin_s: float, seed: int = 0) -> Policy:
    """The simulated policy of live configuration `config`; `pin_s`: continuum's T."""
    if config not in SIM_POLICY:
        raise ValueError(f"the twin has no simulated policy for configuration {config!r}; "
                         f"give some of {', '.join(SIM_POLICY)}")
    predictor = SegmentPredictor(parse_length_predictor(DEFAULT_PREDICTOR, seed),
                                 parse_api_estimator(DEFAULT_API_ESTIMATOR))
    policy = make_policy(SIM_POLICY[config], cost, predictor, prefix_cache=True, rest="gittins")
    if config == "continuum":
        policy = replace(policy, rule=StrategyRule.TTL, ttl=ConstantTtl(pin_s))
    if config == "infercept":
        policy = replace(policy, reads_true_call_time=False)
    return policy
