"""A steady stream of short requests and one long one, under each starvation variant."""

import pytest

from marsched.policy import make_policy
from marsched.sim.engine import Simulator
from simhelpers import COST, single, small_profile

STREAM_END_S = 60.0


def _workload():
    requests = [single("long", 1.0, 600, 100)]
    # Short requests every 70 ms for a minute: within the small engine's capacity, but they keep its memory busy.
    requests += [single(f"s{i}", 0.07 * i, 96, 30) for i in range(int(STREAM_END_S / 0.07))]
    return requests


def _long_finish(**policy_args):
    policy = make_policy("mars", COST, **policy_args)
    result = Simulator(_workload(), small_profile(device_blocks=48, host_blocks=16), policy).run()
    record = next(r for r in result.records if r.request_id == "long")
    assert len(result.records) == len(_workload())  # the run drains: everything finishes
    return record


@pytest.mark.parametrize("variant, threshold", [("age", 10.0), ("iterations", 100)])
def test_long_request_finishes_during_the_stream_with_prevention(variant, threshold):
    record = _long_finish(starvation=variant, starvation_threshold=threshold)
    assert record.finish_s < STREAM_END_S / 2


def test_default_bounds_the_wait_near_its_threshold():
    # MARS's default (`age`, 15 s): promoted after 15 s of waiting and first in line then.
    record = _long_finish()
    assert 15.0 <= record.max_wait_s < 20.0


def test_long_request_waits_for_the_stream_to_end_without_prevention():
    with_prevention = _long_finish()
    without = _long_finish(starvation="off")
    assert without.finish_s >= STREAM_END_S * 0.9
    assert without.e2e_s > 2 * with_prevention.e2e_s


def test_published_rule_does_not_count_fresh_arrivals():
    # The MARS code counts only requests that ran before: a fresh arrival starves as with prevention off.
    published = _long_finish(starvation="published")
    assert published.finish_s >= STREAM_END_S * 0.9
    assert published.preemptions == 0


@pytest.mark.parametrize("threshold", [10, 1000])
def test_threshold_sets_how_long_it_waits(threshold):
    waited = _long_finish(starvation="iterations", starvation_threshold=threshold).max_wait_s
    assert waited <= _long_finish(starvation="off").max_wait_s


# --- the `age` rule on the queue itself -----------------------------------------------------

from marsched.policy import WaitingQueue  # noqa: E402
from marsched.policy.load import EngineLoad  # noqa: E402
from marsched.policy.progress import RequestProgress  # noqa: E402


def _at(now_s):
    return EngineLoad(now_s=now_s, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _waiting(policy, queue, rid, arrival_s, prompt, output, now_s):
    progress = RequestProgress(single(rid, arrival_s, prompt, output), order_s=arrival_s)
    policy.start_segment(progress, _at(now_s))
    queue.push(progress, _at(now_s), iteration=0)
    return progress


def test_age_counts_seconds_and_promotion_lasts_for_life_in_arrival_order():
    policy = make_policy("mars", COST, starvation_threshold=1.0)  # the age variant, 1 s
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
