"""Predicted-peak admission: the formula, the policy's rule, and what it changes in a run."""

import pytest

from marsched.policy import make_policy
from marsched.policy.admission import KvOutlook, predicted_peak_tokens
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.sim.engine import Simulator
from simhelpers import COST, single, small_profile

LOAD = EngineLoad(now_s=0.0, running_kv_tokens=0, iteration_s=0.01, host_free_tokens=10**9)


def test_one_request_peaks_at_its_segment_end():
    assert predicted_peak_tokens([KvOutlook(100, 10, False)]) == 110


def test_peak_is_where_the_first_request_stops_growing():
    # t=10: 110 + 60; t=30: only B, 80. The peak is 170, not the sum of the two peaks (190).
    assert predicted_peak_tokens([KvOutlook(100, 10, False), KvOutlook(50, 30, False)]) == 170


def test_a_preserved_call_keeps_its_memory_past_its_segment_end():
    # A stops at t=10 holding 110 through its call; B reaches 80 at t=30: 190.
    assert predicted_peak_tokens([KvOutlook(100, 10, True), KvOutlook(50, 30, False)]) == 190


def test_rounding_is_counted_per_request_holding_memory():
    outlooks = [KvOutlook(100, 10, False), KvOutlook(50, 30, False)]
    assert predicted_peak_tokens(outlooks, rounding_tokens=8) == 170 + 2 * 8
    assert predicted_peak_tokens([], rounding_tokens=8) == 0


def test_equal_segment_ends_are_counted_once():
    assert predicted_peak_tokens([KvOutlook(10, 5, False), KvOutlook(20, 5, False)]) == 40


def _progress(rid, prompt, output, policy):
    progress = RequestProgress(single(rid, 0.0, prompt, output), order_s=0.0)
    policy.start_segment(progress, LOAD)
    return progress


def test_policy_admits_only_what_fits_at_the_predicted_peak():
    mars = make_policy("mars", COST)
    running = [_progress("a", 100, 100, mars)]
    candidate = _progress("b", 100, 100, mars)
    # a peaks at 200 and b at 200 at the same moment: 400 tokens plus a block each for rounding.
    assert not mars.admits(candidate, running, 0, 431, block_tokens=16)
    assert mars.admits(candidate, running, 0, 432, block_tokens=16)
    assert not mars.admits(candidate, running, 1, 432, block_tokens=16)  # memory held outside the batch counts
    assert mars.admits(candidate, [], 0, 1, block_tokens=16)  # an empty engine always takes the head


def test_greedy_admission_admits_anything():
    infercept = make_policy("infercept", COST)
    running = [_progress("a", 100, 100, infercept)]
    assert infercept.admits(_progress("b", 100, 100, infercept), running, 0, 1, block_tokens=16)
    assert make_policy("mars", COST, admission="greedy").admits(_progress("b", 100, 100, infercept), running, 0, 1, 16)


def _run(admission):
    # Three requests whose prompts fit together (300 of 384 tokens) but whose outputs do not (600).
    requests = [single(f"r{i}", 0.0, 100, 100) for i in range(3)]
    policy = make_policy("mars", COST, admission=admission)
    return Simulator(requests, small_profile(device_blocks=24), policy).run()


def test_predicted_peak_admission_avoids_the_preemptions_greedy_admission_causes():
    greedy, peak = _run("greedy"), _run("predicted-peak")
    assert sum(r.preemptions for r in greedy.records) > 0
    assert sum(r.preemptions for r in peak.records) == 0
    assert len(peak.records) == 3


def test_unknown_admission_rule_lists_the_valid_ones():
    with pytest.raises(ValueError, match="greedy, predicted-peak"):
        make_policy("mars", COST, admission="lazy")


def test_admission_from_outlooks_is_open_when_greedy_or_when_nothing_runs():
    big = [KvOutlook(1000, 1000, False)]
    greedy = make_policy("mars", COST, admission="greedy")
    assert greedy.admits_outlooks(KvOutlook(1000, 1000, False), big, 0, 1, block_tokens=16)
    mars = make_policy("mars", COST)
    assert mars.admits_outlooks(KvOutlook(1000, 1000, False), [], 0, 1, block_tokens=16)
    assert not mars.admits_outlooks(KvOutlook(1000, 1000, False), big, 0, 1, block_tokens=16)


def test_only_a_preserved_call_before_a_later_segment_holds_memory_after_the_segment():
    from marsched.policy import Strategy
    from simhelpers import two_segment
    mars = make_policy("mars", COST)
    progress = RequestProgress(two_segment("r", 0.0, 100, 60, 2.0, 10, 40), order_s=0.0)
    mars.start_segment(progress, LOAD)
    for strategy, held in ((Strategy.DISCARD, False), (Strategy.SWAP, False), (Strategy.PRESERVE, True)):
        progress.strategy = strategy
        assert mars.kv_outlook(progress).held_after is held, strategy
    last = RequestProgress(single("s", 0.0, 100, 40), order_s=0.0)
    mars.start_segment(last, LOAD)
    last.strategy = Strategy.DISCARD
    assert mars.kv_outlook(last).held_after is False
