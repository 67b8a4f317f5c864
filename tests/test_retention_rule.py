"""The rule that decides what a conversation keeps between its turns (`marsched.policy.retention`)."""

from __future__ import annotations

import math

import pytest

from marsched.policy import CostModel, EngineLoad, Strategy, make_policy
from marsched.policy.retention import GapEstimator, RetentionMode, RetentionRule, parse_retention
from marsched.policy.waste import call_wastes
from marsched.vllm.config import MarsConfig

COST = CostModel(seconds_per_token=2e-5, seconds_per_iteration=0.01, token_budget=2048, swap_tokens_per_s=1e6)


def load(host_free_tokens: int = 10**6, running_kv_tokens: int = 0) -> EngineLoad:
    return EngineLoad(0.0, running_kv_tokens, 0.01, host_free_tokens)


@pytest.mark.parametrize("spec, mode, fixed_s", [("policy", RetentionMode.POLICY, 0.0), ("off", RetentionMode.OFF, 0.0),
                                                 ("fixed:2.5", RetentionMode.FIXED, 2.5), (" fixed:30 ", RetentionMode.FIXED, 30.0)])
def test_parse_retention(spec, mode, fixed_s):
    rule = parse_retention(spec, limit_s=9)
    assert (rule.mode, rule.fixed_s, rule.limit_s) == (mode, fixed_s, 9)


@pytest.mark.parametrize("spec", ["", "fixed", "fixed:", "always", "Policy", "always:5", "policy:5"])
def test_bad_retention_is_named(spec):
    with pytest.raises(ValueError, match=f"retention '{spec}': give policy, off or fixed:SECONDS"):
        parse_retention(spec)


@pytest.mark.parametrize("spec", ["fixed:0", "fixed:-1", "fixed:inf", "fixed:nan", "fixed:x", "fixed:1:2"])
def test_a_bad_fixed_time_is_named(spec):
    with pytest.raises(ValueError, match=f"retention '{spec}': fixed:SECONDS needs a number of seconds > 0"):
        parse_retention(spec)


def test_times_below_a_second_are_valid():
    assert parse_retention("fixed:0.5").fixed_s == 0.5
    assert RetentionRule(RetentionMode.FIXED, 0.25, limit_s=0.5).limit_s == 0.5
    for fixed_s in (0.0, -1.0):
        with pytest.raises(ValueError, match="fixed retention needs a time > 0 s"):
            RetentionRule(RetentionMode.FIXED, fixed_s)


def test_the_limit_must_be_positive_and_bounds_a_fixed_time():
    with pytest.raises(ValueError, match="limit"):
        RetentionRule(limit_s=0)
    assert RetentionRule(RetentionMode.FIXED, 100.0, limit_s=5).decide(
        make_policy("mars", COST), 1000, 1.0, load()).hold_s == 5


def test_off_keeps_nothing_and_fixed_preserves_whatever_the_size_or_gap():
    policy = make_policy("mars", COST)
    off = parse_retention("off").decide(policy, 5000, 0.0, load())
    assert (off.strategy, off.hold_s) == (Strategy.DISCARD, 0.0)
    choice = parse_retention("fixed:3", limit_s=60).decide(policy, 10**6, 10**4, load())
    assert (choice.strategy, choice.hold_s) == (Strategy.PRESERVE, 3.0)


@pytest.mark.parametrize("context, gap_s, host_free", [(100, 0.0, 10**6), (100, 0.001, 10**6), (2000, 1.5, 10**6),
                                                       (2000, 1.5, 0), (50_000, 60.0, 10**6), (50_000, 60.0, 0)])
def test_the_policy_rule_takes_the_cheapest_waste_for_the_predicted_gap(context, gap_s, host_free):
    policy = make_policy("mars", COST)
    choice = RetentionRule(limit_s=40).decide(policy, context, gap_s, load(host_free))
    wastes = call_wastes(context, gap_s, 0, COST)
    allowed = [Strategy.PRESERVE, Strategy.DISCARD] + ([Strategy.SWAP] if host_free >= context else [])
    assert wastes.of(choice.strategy) == min(wastes.of(s) for s in allowed)
    assert choice.hold_s == (0.0 if choice.strategy is Strategy.DISCARD else 40)


def test_a_short_gap_is_preserved_and_a_long_one_leaves_the_device():
    policy = make_policy("mars", COST)
    rule = RetentionRule()
    assert rule.decide(policy, 2000, 0.0, load()).strategy is Strategy.PRESERVE
    assert rule.decide(policy, 2000, 600.0, load()).strategy is Strategy.SWAP
    assert rule.decide(policy, 2000, 600.0, load(host_free_tokens=0)).strategy is Strategy.DISCARD


def test_each_policy_keeps_its_own_rule():
    assert make_policy("vllm", COST).strategy_for_gap(2000, 0.0, load()) is Strategy.DISCARD  # stock: nothing kept
    for name, strategy in (("preserve", Strategy.PRESERVE), ("discard", Strategy.DISCARD), ("swap", Strategy.SWAP)):
        assert make_policy(name, COST).strategy_for_gap(2000, 600.0, load()) is strategy
    # INFERCEPT decides at the call like MARS ahead of it: the same cheapest waste for the same gap.
    for gap_s in (0.0, 1.0, 600.0):
        assert (make_policy("infercept", COST).strategy_for_gap(2000, gap_s, load())
                is make_policy("mars", COST).strategy_for_gap(2000, gap_s, load()))


def test_gap_estimate_is_the_stated_time_else_the_geometric_mean_of_observed_gaps():
    gaps = GapEstimator()
    assert gaps.predict(None) == 1.0  # the prior
    assert gaps.predict(7.5) == 7.5
    for gap in (2.0, 8.0):
        gaps.observe(gap)
    assert math.isclose(gaps.predict(None), math.exp((math.log(1.0) + math.log(2.0) + math.log(8.0)) / 3))
    gaps.observe(0.0)  # an immediate follow-up stays finite in log space
    assert 0 < gaps.predict(None) < 1.0


def test_mars_config_checks_retention_where_the_user_sets_it():
    assert MarsConfig(retention="fixed:5", retention_limit_s=30).retention_rule().name == "fixed:5"
    for bad in ({"retention": "sometimes"}, {"retention_limit_s": -1}, {"retention_limit_s": "60"},
                {"retention_limit_s": True}):
        with pytest.raises(ValueError, match="retention"):
            MarsConfig(**bad)
    assert MarsConfig.from_dict({"retention": "off"}).retention_rule().mode is RetentionMode.OFF
