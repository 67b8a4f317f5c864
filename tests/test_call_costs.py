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
