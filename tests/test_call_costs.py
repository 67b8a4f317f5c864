"""`CallCosts` (one call's wastes with Tfwd evaluated once) gives what the waste and ranking
formulas give, to the bit: the MARS key's later calls are priced through it."""

import math
import random

from marsched.policy.cost_model import CostModel
from marsched.policy.ranking import call_area, call_area_of
from marsched.policy.strategy import Strategy
from marsched.policy.waste import CallCosts, call_wastes, cheapest, discard_waste, preserve_waste, swap_waste

_ORDER = (Strategy.PRESERVE, Strategy.SWAP, Strategy.DISCARD)


def _least(wastes, swap_allowed=True):
    """The rule as first written: the least waste, ties to the earlier of Preserve, Swap, Discard."""
    candidates = [s for s in _ORDER if swap_allowed or s is not Strategy.SWAP]
    return min(candidates, key=wastes.of)


def _costs(rng):
    return CostModel(seconds_per_token=rng.uniform(1e-6, 1e-3), seconds_per_iteration=rng.uniform(0, 0.03),
                     token_budget=rng.choice([16, 512, 8192]), swap_tokens_per_s=rng.uniform(1e4, 1e6),
                     seconds_per_context_token=rng.choice([0.0, 4e-8]), seconds_per_attention_pair=rng.choice([0.0, 9e-10]))


def test_call_costs_agree_with_the_waste_and_area_formulas_to_the_bit():
    rng = random.Random(7)
    for _ in range(3000):
        cost = _costs(rng)
        context = rng.randint(1, 200_000)
        api_s = rng.choice([0.0, rng.uniform(0, 0.01), rng.expovariate(0.1)])
        kept = rng.choice([None, rng.randint(0, context + 10)])
        batch = rng.randint(0, 500_000)
        call = CallCosts.of(context, api_s, cost, kept)
        wastes = call_wastes(context, api_s, batch, cost, kept)
        assert call.wastes(batch) == wastes
        assert (call.preserve, call.swap) == (preserve_waste(context, api_s), swap_waste(context, cost, kept))
        assert call.wastes(batch).discard == discard_waste(context, batch, cost, kept)
        assert call.cheapest(batch) is _least(wastes)
        assert cheapest(wastes, swap_allowed=False) is _least(wastes, swap_allowed=False)
        for strategy in Strategy:
            assert call_area_of(call, strategy) == call_area(strategy, context, api_s, cost, kept)
        bound = call.discard_cheapest_below()
        if math.isfinite(bound) and bound > 0:
            assert call.cheapest(int(bound) - 1) is Strategy.DISCARD
            assert call.cheapest(int(bound)) is not Strategy.DISCARD
        elif bound == 0:
            assert call.cheapest(0) is not Strategy.DISCARD


def test_ties_go_to_preserve_then_swap_and_discard_must_be_strictly_cheapest():
    # Exact in binary: Tfwd(10) = 10/1024 s (chunks of 8 and 2), Tswap(10) = 10/128 s.
    cost = CostModel(seconds_per_token=2**-10, seconds_per_iteration=0.0, token_budget=8, swap_tokens_per_s=128.0)
    call = CallCosts.of(10, 0.25, cost)
    assert (call.recompute_s, call.preserve, call.swap) == (10 / 1024, 2.5, 1.5625)
    # Discard 10/1024 × (10 + batch) against Swap's 1.5625: below it while the batch is under 150.
    assert call.cheapest(149) is Strategy.DISCARD
    assert call.cheapest(150) is Strategy.SWAP  # equal to Swap: not taken
    assert call.discard_cheapest_below() == 150
    tie = CallCosts.of(10, 0.15625, cost)  # Preserve 1.5625, as Swap
    assert tie.cheapest(150) is Strategy.PRESERVE
    assert tie.cheapest(149) is Strategy.DISCARD


def test_discard_only_at_an_empty_batch_has_its_bound_at_one():
    # Tfwd(10) = 10/1024 s: Discard 0.09765625 at batch 0, 0.107421875 at batch 1; Preserve 10 × 0.01 = 0.1.
    cost = CostModel(seconds_per_token=2**-10, seconds_per_iteration=0.0, token_budget=8, swap_tokens_per_s=128.0)
    call = CallCosts.of(10, 0.01, cost)
    assert call.cheapest(0) is Strategy.DISCARD and call.cheapest(1) is Strategy.PRESERVE
    assert call.discard_cheapest_below() == 1


def test_attention_pairs_are_a_whole_number():
    from marsched.policy.cost_model import attention_pairs

    assert attention_pairs(3, 2) == 12 and isinstance(attention_pairs(3, 2), int)  # the trace logs an integer


def _policy_and_progress():
    from marsched.policy import make_policy
    from marsched.policy.load import EngineLoad
    from marsched.policy.progress import RequestProgress
    from marsched.workload import ApiCall, ApiType, build_request

    cost = CostModel(seconds_per_token=1e-4, seconds_per_iteration=0.01, token_budget=64, swap_tokens_per_s=1e4)
    policy = make_policy("mars", cost)
    request = build_request("R", 100, [(4, ApiCall(ApiType.OTHER, 1.0, 10)), (3, ApiCall(ApiType.OTHER, 0.5, 5)),
                                       (3, ApiCall(ApiType.OTHER, 0.2, 2)), (2, None)])
    progress = RequestProgress(request, order_s=0.0)
    load = EngineLoad(0.0, 0, 0.01, 10_000)
    policy.start_segment(progress, load)
    return policy, progress, load


def test_a_key_prices_each_later_call_once_and_recomputes_no_tfwd_it_knows(monkeypatch):
    from marsched.policy import waste

    policy, progress, load = _policy_and_progress()
    built = []
    original = waste.CallCosts.of.__func__
    monkeypatch.setattr(waste.CallCosts, "of", classmethod(lambda cls, *a, **k: built.append(a) or original(cls, *a, **k)))
    slow = []
    recompute = CostModel.recompute_time
    monkeypatch.setattr(CostModel, "recompute_time", lambda self, tokens: slow.append(tokens) or recompute(self, tokens))
    first = policy.memory_time_form(progress, load)
    # Later segments 1 and 2 call (segment 3 is the last); the current segment's call is priced too.
    assert len(built) == 3
    built.clear()
    slow.clear()
    assert policy.memory_time_form(progress, load) == first
    assert len(built) == 3
    assert slow == []  # every Tfwd came from the memo


def test_the_tfwd_memo_starts_again_at_its_limit(monkeypatch):
    from marsched.policy import policy as policy_module

    policy, _, _ = _policy_and_progress()
    monkeypatch.setattr(policy_module, "_RECOMPUTE_MEMO", 2)
    for tokens in (1, 2, 3, 4, 5):
        assert policy.recompute_time(tokens) == policy.cost.recompute_time(tokens)
        assert len(policy._recompute_memo[1]) <= 2


def test_a_form_built_without_a_batch_range_does_not_follow_the_batch():
    from marsched.policy.ranking import RankingTerms, remaining_area_form

    policy, progress, load = _policy_and_progress()
    assert remaining_area_form(policy.outlook(progress, load), policy.cost, RankingTerms()).follows_running_kv is False
