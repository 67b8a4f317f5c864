"""The `fcfs-wait` starvation rule: the FCFS wait estimate, and a threshold that moves with it.

Fast, so that mutation testing runs them.
"""

import pytest

from marsched.policy import WaitingQueue, make_policy
from marsched.policy.fcfs_wait import FcfsWait
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.registry import DEFAULT_STARVATION, starvation_config
from marsched.sim.engine import Simulator
from simhelpers import COST, single, small_profile
from test_trace_consistency import _workload


def _at(now_s):
    return EngineLoad(now_s=now_s, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _waiting(policy, queue, rid, now_s, output):
    progress = RequestProgress(single(rid, now_s, 10, output), order_s=now_s)
    policy.start_segment(progress, _at(now_s))
    queue.push(progress, _at(now_s), iteration=0)
    return progress


def test_the_estimate_is_the_age_of_the_oldest_request_fcfs_would_not_have_started():
    fcfs = FcfsWait()
    assert fcfs.wait_s(5.0) == 0.0  # nothing arrived: a new request would not wait
    fcfs.arrive("a", 1.0, 10)
    fcfs.arrive("b", 2.0, 10)
    fcfs.arrive("c", 4.0, 10)
    assert fcfs.wait_s(6.0) == 5.0  # nothing served: FCFS would not have started a
    assert fcfs.wait_s(1.5) == 0.5
    fcfs.decoded("b", 9)  # served out of order: the work counts, whoever's it was
    assert fcfs.wait_s(6.0) == 4.0  # FCFS would be running a now; b waits
    fcfs.decoded("c", 1)
    assert fcfs.wait_s(6.0) == 4.0  # exactly a's work served: b starts only with more
    fcfs.decoded("b", 50)  # b decodes past its prediction: only its own 10 count (1 of them left)
    assert fcfs.wait_s(6.0) == 2.0  # b started too: c is the one FCFS keeps waiting
    fcfs.finished("b")  # b had nothing left to count
    assert fcfs.wait_s(6.0) == 2.0
    fcfs.finished("a")  # ends: the rest of its predicted work counts as served
    assert fcfs.wait_s(6.0) == 0.0
    fcfs.finished("c")
    assert fcfs.served_tokens == 30
    fcfs.decoded("gone", 5)  # an unknown or ended request changes nothing
    fcfs.finished("gone")
    assert fcfs.served_tokens == 30 and fcfs.wait_s(6.0) == 0.0


def test_a_request_brings_at_least_one_unit_of_work():
    fcfs = FcfsWait()
    fcfs.arrive("empty", 1.0, 0)  # predicted to decode nothing: still counts as one unit
    fcfs.arrive("next", 2.0, 5)
    fcfs.decoded("empty", 3)
    assert fcfs.served_tokens == 1
    assert fcfs.wait_s(3.0) == 1.0  # next has not started


def test_fcfs_wait_is_the_default_and_takes_a_multiple():
    assert DEFAULT_STARVATION == "fcfs-wait"
    assert make_policy("mars", COST).starvation.fcfs_multiple == 1.1
    assert starvation_config("fcfs-wait:2.5").fcfs_multiple == 2.5
    for bad, message in [("fcfs-wait:x", "must be a number"), ("fcfs-wait:0", "must be > 0"),
                         ("fcfs-wait:inf", "must be > 0"), ("age:2", "only fcfs-wait takes a multiple"),
                         ("nope", "unknown starvation variant")]:
        with pytest.raises(ValueError, match=message):
            make_policy("mars", COST, starvation=bad)


def test_the_threshold_is_the_larger_of_the_floor_and_the_multiple_of_the_fcfs_wait():
    policy = make_policy("mars", COST, starvation="fcfs-wait:2", starvation_threshold=1.0)
    queue = WaitingQueue(policy)
    assert queue.threshold(0.0) == 1.0  # an empty engine: the floor
    old = _waiting(policy, queue, "old", 0.0, 100)
    _waiting(policy, queue, "new", 3.0, 5)
    assert queue.threshold(3.0) == 6.0  # nothing served: FCFS would not have started old, in for 3 s
    assert queue.promote_starving(0, now_s=3.0) == []  # old waited 3 s, under 6
    assert queue.seconds_to_next_promotion(3.0) == 3.0  # at the threshold as it stands now
    queue.remove("new", 0, now_s=3.0)  # new runs (ranked ahead) and ends
    queue.decoded("new", 5)
    queue.finished("new")  # five units served: FCFS would have started old, and new would wait
    assert queue.threshold(4.0) == 2.0  # 2 × new's 1 s
    assert [p.request_id for p in queue.promote_starving(0, now_s=4.0)] == ["old"]  # waited 4 s
    queue.decoded("old", 40)  # old part way: under FCFS new would still be waiting
    assert queue.threshold(5.0) == 4.0  # 2 × new's 2 s
    queue.finished("old")  # ends early: the rest of its predicted work counts as served
    assert queue.threshold(5.0) == 1.0  # FCFS would make nobody wait: the floor
    assert old.elder  # for life, as under `age`


def test_a_later_stay_in_the_queue_is_not_a_new_arrival():
    policy = make_policy("mars", COST, starvation="fcfs-wait:1", starvation_threshold=1.0)
    queue = WaitingQueue(policy)
    first = _waiting(policy, queue, "a", 0.0, 10)
    assert queue.pop(0, now_s=0.5) is first
    queue.push(first, _at(5.0), iteration=0)  # back after a call: still the one that arrived at 0
    assert queue.threshold(6.0) == 6.0


def test_off_and_fixed_variants_keep_no_estimate():
    for variant in ("off", "age", "published"):
        queue = WaitingQueue(make_policy("mars", COST, starvation=variant))
        _waiting(queue.policy, queue, "a", 0.0, 10)
        assert queue.threshold(100.0) == queue.policy.starvation.threshold


def test_the_simulator_counts_every_decoded_token_as_served():
    # Oracle predictions: the served work is exactly what the requests have decoded so far.
    requests = _workload()
    checked = []

    def check(sim):
        finished = {r.request_id for r in sim.records}
        decoded = sum(r.output_tokens for r in requests if r.request_id in finished)
        for live in sim.live.values():
            progress = live.progress
            decoded += sum(s.output_tokens for s in progress.request.segments[:progress.segment_index])
            decoded += progress.generated
        assert sim.queue.fcfs_wait.served_tokens == decoded
        checked.append(sim.now)

    Simulator(requests, small_profile(device_blocks=20), make_policy("mars", COST), on_step=check).run()
    assert len(checked) > 10


def test_ended_requests_leave_no_work_owed_whatever_was_predicted():
    # Noisy predictions: requests end before or after their predicted work. Once every request
    # has ended, everything that arrived counts as served, so a new arrival would not wait.
    from marsched.predict import parse_api_estimator, parse_length_predictor
    from marsched.predict.segment import SegmentPredictor

    predictor = SegmentPredictor(parse_length_predictor("noisy:0.5", 3), parse_api_estimator("oracle"))
    sim = Simulator(_workload(), small_profile(device_blocks=20), make_policy("mars", COST, predictor=predictor))
    sim.run()
    assert sim.queue.fcfs_wait.wait_s(sim.now + 100.0) == 0.0


def test_a_multiple_needs_the_seconds_clock():
    from marsched.policy.policy import StarvationConfig

    with pytest.raises(ValueError, match="a threshold relative to the FCFS wait needs the seconds clock"):
        StarvationConfig(100, fcfs_multiple=1.0)  # iterations
