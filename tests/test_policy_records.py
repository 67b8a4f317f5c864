"""What each rule records when it fixes a strategy, and the messages of misconfigured policies."""

from __future__ import annotations

import math

import pytest

from marsched.policy import CostModel, Order, Policy, Strategy, StrategyAssignment, StrategyRule, WaitingQueue, make_policy
from marsched.policy.admission import KvOutlook, predicted_peak_tokens
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.predict.segment import SegmentPredictor
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST, single, two_segment

NOW = 3.5
LOAD = EngineLoad(now_s=NOW, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _progress(policy, api_s=10.0):
    progress = RequestProgress(two_segment("r", 0.0, 100, 20, api_s, 5, 10), order_s=0.0)
    policy.start_segment(progress, LOAD)
    return progress


def test_fixed_rule_records_its_strategy_at_the_segment_start():
    progress = _progress(make_policy("swap", COST))
    assert progress.assignments == [StrategyAssignment(0, Strategy.SWAP, NOW, 0, 0.0, "fixed")]


def test_ahead_rule_records_what_it_decided_from():
    progress = _progress(make_policy("mars", COST))
    # C = 100 + 20 at the call, T̂ = 10 s (oracle): swapping 120 tokens costs 2·(120/20,000)·120 = 1.44 token·s.
    assert progress.assignments == [StrategyAssignment(0, Strategy.SWAP, NOW, 120, 10.0, "ahead")]


def test_vllm_rule_records_the_discard_at_the_call():
    policy = make_policy("vllm", COST)
    progress = _progress(policy)
    assert progress.assignments == []
    progress.computed_tokens = 119
    assert policy.strategy_at_call(progress, LOAD) is Strategy.DISCARD
    assert progress.assignments == [StrategyAssignment(0, Strategy.DISCARD, NOW, 0, 0.0, "fixed")]


def test_at_call_rule_records_the_actual_context_and_call_time():
    policy = make_policy("infercept", COST)
    progress = _progress(policy, api_s=0.0001)
    progress.computed_tokens = 119
    assert policy.strategy_at_call(progress, LOAD) is Strategy.PRESERVE
    assert progress.assignments == [StrategyAssignment(0, Strategy.PRESERVE, NOW, 119, 0.0001, "at-call")]


def test_reconsidering_records_the_time_left():
    policy = make_policy("infercept", COST)
    progress = _progress(policy, api_s=10.0)
    progress.computed_tokens = 119
    progress.strategy = Strategy.PRESERVE
    progress.api_started_s = NOW - 1.0
    assert policy.reconsider(progress, LOAD) is Strategy.SWAP
    assert progress.assignments == [StrategyAssignment(0, Strategy.SWAP, NOW, 119, 9.0, "reconsidered")]
    assert policy.reconsider(progress, LOAD) is None  # no longer preserved: nothing to reconsider
    assert make_policy("mars", COST).reconsider(progress, LOAD) is None  # MARS never reconsiders


@pytest.mark.parametrize("name, api_s", [("swap", 10.0), ("infercept", 9.0)])
def test_host_full_fallback_records_its_reason(name, api_s):
    policy = make_policy(name, COST)
    progress = _progress(policy, api_s=10.0)
    progress.computed_tokens = 119
    progress.api_started_s = NOW - 1.0  # INFERCEPT weighs the 9 s left; the fixed rule its prediction
    assert policy.host_full_fallback(progress, LOAD) is Strategy.DISCARD
    assert progress.assignments[-1] == StrategyAssignment(0, Strategy.DISCARD, NOW, 119, api_s, "host-full")


def test_swap_is_left_out_when_the_host_has_no_room():
    policy = make_policy("infercept", COST)
    progress = _progress(policy, api_s=10.0)
    progress.computed_tokens = 119
    full = EngineLoad(now_s=NOW, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=118)
    assert policy.strategy_at_call(progress, full) is Strategy.DISCARD
    exact = EngineLoad(now_s=NOW, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=119)
    assert policy.strategy_at_call(progress, exact) is Strategy.SWAP  # exactly enough room
    # Ahead of time the host's room at the call is unknown: MARS may plan a swap with a full host now.
    assert _progress_with(make_policy("mars", COST), full).strategy is Strategy.SWAP


def _progress_with(policy, load):
    progress = RequestProgress(two_segment("r", 0.0, 100, 20, 10.0, 5, 10), order_s=0.0)
    policy.start_segment(progress, load)
    return progress


def _three_segments(first_call_s, second_call_s, outputs=(20, 20, 10)):
    call = lambda s: ApiCall(ApiType.OTHER, s, 5)  # noqa: E731
    return build_request("t", 100, [(outputs[0], call(first_call_s)), (outputs[1], call(second_call_s)),
                                    (outputs[2], None)])


def test_later_calls_may_be_swapped_whatever_the_host_holds_now():
    mars = make_policy("mars", COST)
    progress = RequestProgress(_three_segments(0.0001, 10.0), order_s=0.0)
    full = EngineLoad(now_s=NOW, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=0)
    mars.start_segment(progress, full)
    outlook = mars.outlook(progress, full)
    # The later 10 s call at a predicted 145 + 20 = 165 tokens is planned as a swap, the host's room then unknown.
    assert outlook[1].strategy is Strategy.SWAP and outlook[1].context_tokens == 125
    assert outlook[2].strategy is None


def test_remaining_tokens_counts_the_current_and_later_segments():
    sjf = make_policy("sjf", COST)
    progress = RequestProgress(_three_segments(1.0, 1.0, outputs=(20, 30, 7)), order_s=0.0)
    sjf.start_segment(progress, LOAD)
    assert sjf.remaining_tokens(progress) == 20 + 30 + 7
    progress.generated = 5
    assert sjf.remaining_tokens(progress) == 15 + 30 + 7
    progress.generated = 25  # past the prediction: one more at least
    assert sjf.remaining_tokens(progress) == 1 + 30 + 7
    assert sjf.queue_key(progress, LOAD) == 38.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(refresh_interval=0), "refresh interval must be >= 1 iteration, got 0"),
    (dict(fixed_strategy=Strategy.SWAP), "a fixed strategy goes with the FIXED rule, and only with it"),
])
def test_policy_refuses_inconsistent_settings(kwargs, message):
    values = dict(name="p", order=Order.FCFS, rule=StrategyRule.AT_CALL, cost=COST, predictor=SegmentPredictor.oracle())
    values.update(kwargs)
    with pytest.raises(ValueError) as error:
        Policy(**values)
    assert str(error.value) == message


def test_unknown_policy_message_lists_every_name():
    with pytest.raises(ValueError) as error:
        make_policy("fifo", COST)
    assert str(error.value) == "unknown policy 'fifo'; valid: vllm, vllm-v0, vllm-offload, infercept, infercept-code, sjf, preserve, discard, swap, mars, mars-boost, mars-boost-label, mars-nudge, continuum, continuum-public, autellix"


def test_threshold_with_prevention_off_is_refused_in_so_many_words():
    with pytest.raises(ValueError) as error:
        make_policy("mars", COST, starvation="off", starvation_threshold=5)
    assert str(error.value) == ("starvation threshold 5 given with starvation 'off': "
                                "drop the threshold or choose a variant (age, published, iterations)")


def test_default_refresh_interval_is_every_iteration():
    assert make_policy("mars", COST).refresh_interval == 1


@pytest.mark.parametrize("budget, swap", [(1, 0.5), (128, 1e-3)])
def test_smallest_valid_engines_are_accepted(budget, swap):
    CostModel(seconds_per_token=0.0, seconds_per_iteration=0.01, token_budget=budget, swap_tokens_per_s=swap)


def test_threshold_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        make_policy("mars", COST, starvation_threshold=0.0)


# --- the peak of several requests, held and growing ------------------------------------------


def test_two_held_requests_and_rounding():
    outlooks = [KvOutlook(100, 10, True), KvOutlook(50, 20, True), KvOutlook(10, 30, False)]
    # t=10: 110 + 70 + 20 = 200, 3 growing; t=20: 110 (held) + 70 + 30 = 210, 2 growing + 1 held;
    # t=30: 110 + 70 (both held) + 40 = 220, 1 growing + 2 held. Rounding 4 per request holding KV.
    assert predicted_peak_tokens(outlooks) == 220
    assert predicted_peak_tokens(outlooks, rounding_tokens=4) == 220 + 3 * 4


# --- queue details ---------------------------------------------------------------------------


def test_equal_keys_pop_first_come_first_served():
    policy = make_policy("preserve", COST)
    queue = WaitingQueue(policy)
    for rid in ("a", "b", "c"):
        progress = RequestProgress(single(rid, 0.0, 10, 5), order_s=0.0)
        queue.push(progress, LOAD, iteration=0)
    assert [queue.pop(0, NOW).request_id for _ in range(3)] == ["a", "b", "c"]


def test_promotion_at_exactly_the_threshold_and_past_a_departed_request():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=10)
    queue = WaitingQueue(policy)
    first = RequestProgress(single("first", 0.0, 10, 5), order_s=0.0)
    second = RequestProgress(single("second", 0.0, 500, 400), order_s=0.0)
    for progress in (first, second):
        policy.start_segment(progress, LOAD)
        queue.push(progress, LOAD, iteration=0)
    assert queue.pop(3, NOW) is first  # leaves: its stale count is skipped, not a stop
    assert queue.iterations_to_next_promotion(9) == 1
    assert queue.iterations_to_next_promotion(10) == 1  # due now: at least one iteration
    assert queue.promote_starving(10, NOW) == [second]  # 10 iterations is the threshold, not 11
    assert queue.seconds_to_next_promotion(NOW) is None  # an iteration clock has no seconds deadline


def test_promoted_request_put_back_goes_before_later_promotions():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=1)
    queue = WaitingQueue(policy)
    a, b = (RequestProgress(single(rid, 0.0, 10, 5), order_s=0.0) for rid in ("a", "b"))
    for progress in (a, b):
        policy.start_segment(progress, LOAD)
        queue.push(progress, LOAD, iteration=0)
    assert queue.promote_starving(1, NOW) == [a, b]
    assert queue.pop(1, NOW) is a
    queue.push_back(a)
    assert [p.request_id for p in queue.ordered()] == ["a", "b"]
    assert queue.pop(1, NOW) is a


def test_seconds_count_is_carried_across_stays():
    policy = make_policy("mars", COST, starvation="age", starvation_threshold=10.0)
    queue = WaitingQueue(policy)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    policy.start_segment(progress, LOAD)
    queue.push(progress, EngineLoad(1.0, 0, 0.01, 0), iteration=0)
    assert queue.pop(0, 4.0) is progress and progress.waited_s == 3.0
    queue.push(progress, EngineLoad(20.0, 0, 0.01, 0), iteration=0)
    assert queue.starvation_counter("r", 0, 21.0) == 4.0
    assert queue.seconds_to_next_promotion(21.0) == 6.0
    assert queue.pop(0, 21.0) is progress
    queue.push_back(progress)
    assert progress.waited_s == 0.0 and queue.starvation_counter("r", 0, 22.0) == 5.0


def test_refresh_tolerance_is_inclusive():
    policy = make_policy("mars", COST, starvation="off")
    policy.refresh_tolerance = 0.25  # exact in binary, unlike the default 5%
    queue = WaitingQueue(policy)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    policy.start_segment(progress, LOAD)
    queue.push(progress, LOAD, iteration=0)
    assert queue.refresh(EngineLoad(0.0, 0, 1.0, 0), 1)
    assert not queue.refresh(EngineLoad(0.0, 0, 1.25, 0), 2)  # moved by exactly the tolerance
    assert queue.refresh(EngineLoad(0.0, 0, 1.3, 0), 3)
    assert math.isclose(queue._refreshed_at_s, 1.3)


def test_named_rules_refuses_an_unknown_name_listing_the_valid_ones():
    from marsched.policy.registry import named_rules
    with pytest.raises(ValueError) as error:
        named_rules("fifo")
    assert str(error.value) == "unknown policy 'fifo'; valid: vllm, vllm-v0, vllm-offload, infercept, infercept-code, sjf, preserve, discard, swap, mars, mars-boost, mars-boost-label, mars-nudge, continuum, continuum-public, autellix"


def test_an_fcfs_relative_threshold_needs_the_seconds_clock():
    from marsched.policy.policy import StarvationConfig
    with pytest.raises(ValueError) as error:
        StarvationConfig(threshold=5, fcfs_multiple=2.0)
    assert str(error.value) == "a threshold relative to the FCFS wait needs the seconds clock"


def test_the_run_events_declaration_names_the_fixed_strategy_and_the_ranking_terms():
    """The audit rebuilds the policy from these two fields (audit/declared.py, audit/keys.py)."""
    from dataclasses import asdict

    from marsched.policy.trace_fields import declaration
    assert declaration(make_policy("preserve", COST))["fixed_strategy"] == "preserve"
    assert declaration(make_policy("mars", COST))["fixed_strategy"] is None
    mars = make_policy("mars", COST)
    assert declaration(mars)["terms"] == asdict(mars.terms)


def test_at_call_rule_without_the_true_call_time_prices_the_predicted_one():
    from dataclasses import replace

    told = make_policy("infercept", COST)
    predicted_only = replace(make_policy("infercept", COST), reads_true_call_time=False)
    for policy in (told, predicted_only):
        progress = _progress(policy, api_s=10.0)
        # the estimate says the call is short: keep its KV; the truth (10 s) says swap it
        progress.predictions[0] = replace(progress.predictions[0], api_duration_s=0.0001)
        progress.computed_tokens = 119
        expected = Strategy.SWAP if policy is told else Strategy.PRESERVE
        assert policy.strategy_at_call(progress, LOAD) is expected
        assert progress.assignments[-1].api_s == (10.0 if policy is told else 0.0001)
    # while preserved, the time left is the estimate's: 4 s estimated, 1 s gone, 3 s to price
    progress = _progress(predicted_only, api_s=10.0)
    progress.predictions[0] = replace(progress.predictions[0], api_duration_s=4.0)
    progress.computed_tokens, progress.strategy, progress.api_started_s = 119, Strategy.PRESERVE, NOW - 1.0
    assert predicted_only.reconsider(progress, LOAD) is Strategy.SWAP
    assert progress.assignments[-1].api_s == 3.0
