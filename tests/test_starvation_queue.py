"""The starvation rules on the waiting queue itself: the `age` clock, promotion for life, protection.

Fast, so that mutation testing runs them (tests/test_starvation.py runs whole streams).
"""

import pytest

from marsched.policy import WaitingQueue, make_policy, parse_threshold
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from simhelpers import COST, single


def _at(now_s):
    return EngineLoad(now_s=now_s, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _waiting(policy, queue, rid, arrival_s, prompt, output, now_s):
    progress = RequestProgress(single(rid, arrival_s, prompt, output), order_s=arrival_s)
    policy.start_segment(progress, _at(now_s))
    queue.push(progress, _at(now_s), iteration=0)
    return progress


def test_age_counts_seconds_and_promotion_lasts_for_life_in_arrival_order():
    policy = make_policy("mars", COST, starvation="age", starvation_threshold=1.0)  # 1 s
    queue = WaitingQueue(policy)
    late_long = _waiting(policy, queue, "late-long", 0.5, 900, 400, now_s=0.5)
    early_long = _waiting(policy, queue, "early-long", 0.0, 1000, 500, now_s=0.9)
    _waiting(policy, queue, "short", 1.0, 10, 5, now_s=1.0)
    assert queue.promote_starving(iteration=0, now_s=1.4) == []  # late-long has waited 0.9 s
    assert [p.request_id for p in queue.promote_starving(iteration=0, now_s=1.5)] == ["late-long"]
    assert [p.request_id for p in queue.promote_starving(iteration=0, now_s=1.9)] == ["early-long"]
    # Promoted for life: first come first served among them, by arrival, not by promotion order.
    assert queue.pop(0, now_s=2.0) is early_long
    assert queue.pop(0, now_s=2.0) is late_long
    assert early_long.elder and late_long.elder
    # Back in the queue later (after a call): ahead of the ranking at once, without waiting again.
    queue.push(early_long, _at(9.0), iteration=0)
    assert queue.pop(0, now_s=9.0) is early_long


def test_segment_protection_ends_with_the_segment():
    policy = make_policy("mars", COST)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    policy.start_segment(progress, _at(0.0))
    policy.protect(progress, iteration=7)
    assert policy.is_protected(progress, iteration=10**9)
    progress.segment_index += 1
    assert not policy.is_protected(progress, iteration=8)


def test_quantum_protection_counts_iterations():
    policy = make_policy("mars", COST, starvation="iterations", starvation_quantum=5)
    progress = RequestProgress(single("r", 0.0, 10, 5), order_s=0.0)
    policy.protect(progress, iteration=10)
    assert policy.is_protected(progress, iteration=14)
    assert not policy.is_protected(progress, iteration=15)


def test_published_rule_counts_only_requests_that_ran_before():
    policy = make_policy("mars", COST, starvation="published", starvation_threshold=3)
    queue = WaitingQueue(policy)
    fresh = _waiting(policy, queue, "fresh", 0.0, 10, 5, now_s=0.0)
    assert queue.starvation_counter("fresh", iteration=50, now_s=0.0) == 0
    assert queue.promote_starving(iteration=50, now_s=0.0) == []
    assert queue.iterations_to_next_promotion(50) is None
    requeued = RequestProgress(single("requeued", 0.0, 10, 5), order_s=0.0, ran_before=True)
    policy.start_segment(requeued, _at(0.0))
    queue.push(requeued, _at(0.0), iteration=50)
    assert queue.iterations_to_next_promotion(51) == 2
    assert [p.request_id for p in queue.promote_starving(iteration=53, now_s=0.0)] == ["requeued"]
    assert queue.pop(53, 0.0) is requeued and queue.pop(53, 0.0) is fresh


def test_counter_survives_leaving_the_queue_and_resets_at_promotion():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=10)
    queue = WaitingQueue(policy)
    progress = _waiting(policy, queue, "r", 0.0, 10, 5, now_s=0.0)
    assert queue.pop(4, 0.0) is progress  # left after 4 iterations: the count is carried
    assert progress.waited_iterations == 4
    queue.push(progress, _at(0.0), iteration=20)
    assert queue.starvation_counter("r", 20, 0.0) == 4
    assert queue.iterations_to_next_promotion(20) == 6
    assert queue.promote_starving(26, 0.0) == [progress]
    assert queue.starvation_counter("r", 30, 0.0) == 4  # reset at 26


def test_seconds_to_next_promotion_follows_the_oldest_count():
    policy = make_policy("mars", COST, starvation="age", starvation_threshold=2.0)
    queue = WaitingQueue(policy)
    assert queue.seconds_to_next_promotion(0.0) is None
    _waiting(policy, queue, "a", 0.0, 10, 5, now_s=1.0)
    _waiting(policy, queue, "b", 0.0, 10, 5, now_s=1.5)
    assert queue.seconds_to_next_promotion(1.5) == 1.5
    assert queue.iterations_to_next_promotion(0) is None  # a seconds clock has no iteration deadline
    assert [p.request_id for p in queue.promote_starving(0, now_s=3.0)] == ["a"]
    assert queue.seconds_to_next_promotion(3.0) == 0.5


def test_popped_promoted_request_put_back_stays_first():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=1)
    queue = WaitingQueue(policy)
    first = _waiting(policy, queue, "first", 0.0, 10, 5, now_s=0.0)
    queue.promote_starving(1, 0.0)
    second = _waiting(policy, queue, "second", 0.0, 10, 5, now_s=0.0)
    assert queue.pop(2, 0.0) is first
    queue.push_back(first)
    assert [p.request_id for p in queue.ordered()] == ["first", "second"]
    assert queue.pop(3, 0.0) is first


@pytest.mark.parametrize("kwargs, message", [
    (dict(starvation="never"), "age, published, iterations, autellix, off"),
    (dict(starvation="off", starvation_threshold=5), "given with starvation 'off'"),
    (dict(starvation="iterations", starvation_threshold=0.5), ">= 1"),
    (dict(starvation_threshold=-1.0), "> 0"),
    (dict(starvation="iterations", starvation_quantum=-1), "quantum"),
])
def test_bad_starvation_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_policy("mars", COST, **kwargs)


@pytest.mark.parametrize("text, value", [("off", None), ("None", None), ("15", 15.0), ("0.5", 0.5)])
def test_parse_threshold(text, value):
    assert parse_threshold(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "nan", "inf", "soon"])
def test_parse_threshold_refuses_what_is_not_a_positive_number(text):
    with pytest.raises(ValueError, match="positive number or 'off'"):
        parse_threshold(text)


def test_defaults_per_policy():
    mars = make_policy("mars", COST)
    assert (mars.starvation.threshold, mars.starvation.fcfs_multiple, mars.starvation.for_life, mars.admission.value) == (
        1.0, 2.0, True, "predicted-peak")
    infercept = make_policy("infercept", COST)
    assert (infercept.starvation.threshold, infercept.admission.value) == (None, "greedy")
    # A threshold for a policy without prevention turns on the iteration counter.
    assert make_policy("sjf", COST, starvation_threshold=50).starvation.threshold == 50


def test_records_name_the_starvation_variant_whatever_its_threshold():
    from dataclasses import replace

    from marsched.bench.runner import policy_fields
    from marsched.policy.registry import STARVATION_VARIANTS, starvation_variant

    for name, config in STARVATION_VARIANTS.items():
        assert starvation_variant(config) == name
        if config.threshold is not None:
            assert starvation_variant(replace(config, threshold=config.threshold * 3)) == name
    assert starvation_variant(replace(STARVATION_VARIANTS["age"], for_life=False)) == "custom"
    fields = policy_fields(make_policy("mars", COST, starvation="published", starvation_threshold=7, refresh_interval=3))
    assert fields == {"predictor": "oracle+api:oracle", "rest": "plan", "bound": True, "starvation": "published", "starvation_threshold": 7,
                      "starvation_fcfs_multiple": None, "admission": "predicted-peak", "refresh_interval": 3}
    assert policy_fields(make_policy("infercept", COST))["starvation"] == "off"


def test_promoted_lane_count_and_head_key_leave_out_promoted_requests():
    """`promoted_waiting` counts the promoted lane; `head_key` (the trace's next score) is the best
    key outside it, so a promoted request with a better key does not hide the ranking's head."""
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=3)
    queue = WaitingQueue(policy)
    old_a = _waiting(policy, queue, "old-a", 0.0, 10, 5, now_s=0.0)
    old_b = _waiting(policy, queue, "old-b", 0.0, 12, 5, now_s=0.0)
    new_short = RequestProgress(single("new-short", 0.0, 100, 50), order_s=0.0)
    new_long = RequestProgress(single("new-long", 0.0, 1000, 500), order_s=0.0)
    for progress in (new_short, new_long):
        policy.start_segment(progress, _at(0.0))
        queue.push(progress, _at(0.0), iteration=2)
    assert queue.promoted_waiting == 0
    assert [p.request_id for p in queue.promote_starving(3, 0.0)] == ["old-a", "old-b"]
    assert queue.promoted_waiting == 2
    head = queue.head_key()
    assert head is not None
    assert queue.pop(3, 0.0) is old_a and queue.pop(3, 0.0) is old_b
    assert queue.promoted_waiting == 0
    assert queue.pop(3, 0.0) is new_short
    assert new_short.left_key == head


def test_a_removed_request_is_skipped_and_does_not_block_promotions():
    """`remove` (a request leaving the queue other than by pop) keeps its counter; the dead entry
    left in the heaps neither comes out of `pop` nor stops a later request's promotion."""
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=3)
    queue = WaitingQueue(policy)
    gone = _waiting(policy, queue, "gone", 0.0, 10, 5, now_s=0.0)  # best key, oldest counter
    stay = RequestProgress(single("stay", 0.0, 100, 50), order_s=0.0)
    policy.start_segment(stay, _at(0.0))
    queue.push(stay, _at(0.0), iteration=1)
    queue.remove("gone", iteration=2, now_s=0.0)
    assert gone.waited_iterations == 2 and "gone" not in queue
    assert [p.request_id for p in queue.promote_starving(4, 0.0)] == ["stay"]
    assert queue.pop(4, 0.0) is stay
    assert queue.pop(4, 0.0) is None


def test_a_removed_request_is_skipped_by_pop():
    policy = make_policy("mars", COST)
    queue = WaitingQueue(policy)
    _waiting(policy, queue, "gone", 0.0, 10, 5, now_s=0.0)
    stay = _waiting(policy, queue, "stay", 0.0, 100, 50, now_s=0.0)
    queue.remove("gone", iteration=0, now_s=0.0)
    assert queue.head_key() is not None
    assert queue.pop(0, 0.0) is stay


def test_an_iteration_clock_has_no_seconds_deadline():
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=3)
    queue = WaitingQueue(policy)
    _waiting(policy, queue, "r", 0.0, 10, 5, now_s=0.0)
    assert queue.iterations_to_next_promotion(1) == 2
    assert queue.seconds_to_next_promotion(1.0) is None
