"""The `fcfs-wait` starvation rule: the FCFS wait estimate, and a threshold that moves with it.

Fast, so that mutation testing runs them.
"""

import pytest

from marsched.policy import WaitingQueue, make_policy
from marsched.policy.fcfs_wait import FcfsWait, predicted_work_tokens
from marsched.predict.segment import SegmentPredictor
from marsched.workload.model import ApiCall, ApiType, build_request
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.registry import DEFAULT_STARVATION, starvation_config
from marsched.sim.engine import Phase, Simulator
from simhelpers import COST, single, small_profile, two_segment
from test_trace_consistency import _workload


def _at(now_s):
    return EngineLoad(now_s=now_s, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def _waiting(policy, queue, rid, now_s, output):
    progress = RequestProgress(single(rid, now_s, 10, output), order_s=now_s)
    policy.start_segment(progress, _at(now_s))
    queue.push(progress, _at(now_s), iteration=0)
    return progress


def test_the_fallback_is_the_age_of_the_oldest_request_fcfs_would_not_have_started():
    fcfs = FcfsWait()
    assert fcfs.oldest_unstarted_wait_s(5.0) == 0.0  # nothing arrived
    fcfs.arrive("a", 1.0, 10)
    fcfs.arrive("b", 2.0, 10)
    fcfs.arrive("c", 4.0, 10)
    assert fcfs.oldest_unstarted_wait_s(1.5) == 0.5  # nothing served: FCFS would not have started a
    assert fcfs.oldest_unstarted_wait_s(6.0) == 5.0
    fcfs.served("b", 9)  # served out of order: the work counts, whoever's it was
    assert fcfs.oldest_unstarted_wait_s(6.0) == 4.0  # FCFS would be running a now; b waits
    fcfs.served("c", 1)
    assert fcfs.oldest_unstarted_wait_s(6.0) == 4.0  # exactly a's work served: b starts only with more
    fcfs.served("b", 50)  # b computes past its prediction: only its own 10 count (1 of them left)
    assert fcfs.oldest_unstarted_wait_s(6.0) == 2.0  # b started too: c is the one FCFS keeps waiting
    fcfs.finished("b")  # b had nothing left to count
    assert fcfs.oldest_unstarted_wait_s(6.0) == 2.0
    fcfs.finished("a")  # ends: the rest of its predicted work counts as served
    assert fcfs.oldest_unstarted_wait_s(6.0) == 0.0
    fcfs.finished("c")
    assert fcfs.served_tokens == 30 and fcfs.unserved_tokens == 0
    fcfs.served("gone", 5)  # an unknown or ended request changes nothing
    fcfs.finished("gone")
    assert fcfs.served_tokens == 30 and fcfs.wait_s(6.0) == 0.0


def test_the_estimate_is_the_unserved_work_over_the_recent_service_rate():
    fcfs = FcfsWait(window_s=64.0)  # a sample a second
    assert fcfs.wait_s(0.0) == 0.0  # nothing arrived: a new request would not wait
    fcfs.arrive("a", 0.0, 100)
    fcfs.arrive("b", 0.5, 100)
    assert fcfs.wait_s(1.0) == 1.0  # nothing served yet: no rate, so the fallback (a, in for 1 s)
    fcfs.served("a", 10)
    assert fcfs.service_rate(2.0) == 10.0  # 10 tokens in the busy second since the last call
    assert fcfs.wait_s(2.0) == 19.0  # 190 tokens unserved at 10 a second
    fcfs.served("b", 30)
    assert fcfs.wait_s(2.5) == 16.0  # half a second later: too soon for a new sample, the rate holds
    # Nothing served between 2.5 and 3: that half second is not busy. 40 tokens in 1.5 busy s.
    assert fcfs.wait_s(3.0) == pytest.approx(160 / (40 / 1.5))
    fcfs.finished("a")  # its 90 tokens not yet computed count as served at its end
    assert fcfs.unserved_tokens == 70


def test_stretches_with_nothing_served_do_not_lower_the_rate():
    fcfs = FcfsWait(window_s=64.0)
    fcfs.arrive("a", 0.0, 1000)
    fcfs.wait_s(0.0)
    for t in range(1, 11):  # 20 tokens a second for 10 s
        fcfs.served("a", 20)
        fcfs.wait_s(float(t))
    assert fcfs.service_rate(10.0) == 20.0
    assert fcfs.service_rate(40.0) == 20.0  # 30 s with nothing computed (every request in a call)
    fcfs.served("a", 20)
    assert fcfs.service_rate(41.0) == 20.0  # one more busy second, at the same rate


def test_the_rate_follows_the_last_window_only():
    fcfs = FcfsWait(window_s=8.0)
    fcfs.arrive("a", 0.0, 10_000)
    fcfs.wait_s(0.0)
    t = 0.0
    for tokens in [5] * 20 + [20] * 20:  # 10 s at 10 tokens a second, then 10 s at 40
        t += 0.5
        fcfs.served("a", tokens)
        fcfs.wait_s(t)
        if t == 18.0:  # the sample at 10 s is the window's start: nothing before it counts
            assert fcfs.service_rate(t) == 40.0
    assert fcfs.service_rate(t) == 40.0  # the first 10 s are out of the window
    with pytest.raises(ValueError, match="window must be > 0 s"):
        FcfsWait(window_s=0.0)
    assert FcfsWait(window_s=0.5).window_s == 0.5


def test_one_token_is_a_rate_and_work_served_at_one_moment_is_not():
    fcfs = FcfsWait(window_s=64.0)
    fcfs.arrive("a", 0.0, 100)
    fcfs.wait_s(0.0)
    fcfs.served("a", 1)
    assert fcfs.service_rate(2.0) == 0.5  # one token in two busy seconds
    other = FcfsWait(window_s=64.0)
    other.arrive("a", 0.0, 100)
    other.wait_s(0.0)
    other.served("a", 10)  # told between two queries at the same moment: no busy time to divide by
    assert other.service_rate(0.0) is None
    assert other.service_rate(1.0) is None  # nothing served since: the second was idle
    assert other.wait_s(1.0) == 0.0  # so the fallback: FCFS would have started a, nobody waits


def test_a_request_brings_at_least_one_unit_of_work():
    fcfs = FcfsWait()
    fcfs.arrive("empty", 1.0, 0)  # predicted to compute nothing: still counts as one unit
    fcfs.arrive("next", 2.0, 5)
    fcfs.served("empty", 3)
    assert fcfs.served_tokens == 1
    assert fcfs.oldest_unstarted_wait_s(3.0) == 1.0  # next has not started


def test_a_requests_work_is_what_the_engine_computes_for_it():
    two = two_segment("t", 0.0, 100, 20, 1.0, 30, 40)  # prompt, call returning 30, then 40 more
    predictions = [SegmentPredictor.oracle().predict(two, i) for i in range(2)]
    assert predicted_work_tokens(two.prompt_tokens, predictions) == 100 + 20 + 30 + 40
    trailing = build_request("c", 50, [(10, ApiCall(ApiType.OTHER, 1.0, 99))], 0.0)  # ends with its call
    predictions = [SegmentPredictor.oracle().predict(trailing, 0)]
    assert predicted_work_tokens(trailing.prompt_tokens, predictions) == 60  # the last return is never computed


def test_a_turn_whose_kv_is_held_brings_only_the_rest_of_its_prompt():
    """A server's follow-up turn is a new request whose prompt is the whole history; the KV its
    conversation kept is counted as computed (`MarsScheduler._progress_of`), and is no work."""
    policy = make_policy("mars", COST, starvation="fcfs-wait:2")
    queue = WaitingQueue(policy)
    progress = RequestProgress(single("turn", 0.0, 1000, 20), order_s=0.0)
    policy.start_segment(progress, _at(0.0))
    progress.computed_tokens = 960  # the kept prefix
    queue.push(progress, _at(0.0), iteration=0)
    assert queue.fcfs_wait.unserved_tokens == 40 + 20


def test_fcfs_wait_is_the_default_and_takes_a_multiple():
    assert DEFAULT_STARVATION == "fcfs-wait"
    assert make_policy("mars", COST).starvation.fcfs_multiple == 2.0
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
    old = _waiting(policy, queue, "old", 0.0, 90)  # 10 prompt + 90 output tokens of work
    _waiting(policy, queue, "new", 3.0, 5)  # 15
    assert queue.threshold(3.0) == 6.0  # nothing served, no rate: 2 × old's 3 s
    assert queue.promote_starving(0, now_s=3.0) == []  # old waited 3 s, under 6
    assert queue.seconds_to_next_promotion(3.0) == 3.0  # at the threshold as it stands now
    queue.remove("new", 0, now_s=3.0)  # new runs (ranked ahead) and ends: 15 tokens in a second
    queue.served("new", 15)
    queue.finished("new")
    assert queue.threshold(4.0) == 2 * 100 / 15  # old's 100 tokens at 15 a second, twice
    assert queue.promote_starving(0, now_s=4.0) == []  # waited 4 s, under 13.3
    assert [p.request_id for p in queue.promote_starving(0, now_s=15.0)] == ["old"]  # 15 s: over 13.3
    queue.finished("old")
    assert queue.threshold(16.0) == 1.0  # FCFS would make nobody wait: the floor
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


def test_the_simulator_counts_every_computed_token_as_served():
    # Oracle predictions, every call preserved and room for all: nothing is computed twice, so the
    # served work is what the live requests have computed so far plus the whole work of those done.
    requests = _workload()
    work = {r.request_id: r.prompt_tokens + r.output_tokens + sum(s.api.return_tokens for s in r.segments[:-1])
            for r in requests}
    checked = []

    def computed(live):
        progress = live.progress
        if live.phase is Phase.PAUSED and progress.in_last_segment:  # a trailing call: KV freed at it
            return progress.context_tokens - 1  # all but the last sampled token, never an input
        return progress.computed_tokens

    def check(sim):
        served = sum(work[r.request_id] for r in sim.records)
        served += sum(computed(live) for live in sim.live.values())
        assert sim.queue.fcfs_wait.served_tokens == served
        checked.append(sim.now)

    policy = make_policy("preserve", COST, starvation="fcfs-wait")
    Simulator(requests, small_profile(device_blocks=200), policy, on_step=check).run()
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


def test_the_estimate_keeps_only_the_arrivals_fcfs_would_not_have_started():
    # A long-running server: what FCFS would have started is forgotten as the estimate is asked.
    fcfs = FcfsWait()
    for i in range(1000):
        fcfs.arrive(f"r{i}", float(i), 10)
        fcfs.served(f"r{i}", 10)
        fcfs.finished(f"r{i}")
        fcfs.wait_s(float(i) + 0.5)
    assert len(fcfs._arrived) <= 1 and len(fcfs._samples) <= 70 and not fcfs._owed
