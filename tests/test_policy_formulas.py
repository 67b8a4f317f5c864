import math

import pytest

from marsched.policy import CostModel, Strategy, call_wastes, cheapest
from marsched.policy.ranking import decode_area
from marsched.policy.waste import discard_waste, preserve_waste, swap_waste

COST = CostModel(seconds_per_token=4.63e-5, seconds_per_iteration=0.01, token_budget=384, swap_tokens_per_s=50_000)


def test_recompute_time_counts_budget_sized_chunks():
    full = COST.iteration_time(384)
    assert COST.recompute_time(384) == pytest.approx(full)
    assert COST.recompute_time(1000) == pytest.approx(2 * full + COST.iteration_time(1000 - 768))
    assert COST.recompute_time(0) == 0


def test_waste_formulas_follow_their_definitions():
    assert preserve_waste(1000, 2.0) == 2000
    assert discard_waste(1000, 5000, COST) == pytest.approx(COST.recompute_time(1000) * 6000)
    assert swap_waste(1000, COST) == pytest.approx(2 * 1000 / 50_000 * 1000)


def test_short_calls_preserve_long_calls_move_out():
    assert cheapest(call_wastes(800, 1e-4, 20_000, COST)) is Strategy.PRESERVE
    assert cheapest(call_wastes(800, 30.0, 20_000, COST)) is Strategy.SWAP
    # Without room on the host, a long call with a small batch is cheaper to recompute than to keep.
    assert cheapest(call_wastes(800, 30.0, 1_000, COST), swap_allowed=False) is Strategy.DISCARD
    # ...and with a large batch, recomputing stalls so much memory that keeping it wins.
    assert cheapest(call_wastes(800, 0.5, 200_000, COST), swap_allowed=False) is Strategy.PRESERVE


def test_ties_prefer_preserve():
    assert cheapest(call_wastes(0, 0.0, 0, COST)) is Strategy.PRESERVE


def test_decode_area_is_the_memory_time_triangle():
    # 3 tokens from context 10 at 1 s/iteration: contexts 11, 12, 13 held one iteration each.
    assert decode_area(10, 3, 1.0) == 11 + 12 + 13
    assert math.isclose(decode_area(10, 3, 0.5), 18.0)
