"""Boost's form for predicted sizes (`mars-boost-label`, `policy/size_labels.py`)."""

import math
from dataclasses import replace

import pytest

from marsched.policy.boost import boost_from_excess, boost_key, boost_s, excess_exponent
from marsched.policy.load import EngineLoad
from marsched.policy.progress import RequestProgress
from marsched.policy.registry import make_policy
from marsched.policy.size_labels import MIN_SAMPLES, WINDOW, SizeLabels, label_of, segment_area
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST

GAMMA = 0.2
LOAD = EngineLoad(3.0, 200, 0.02, 1_000, kv_capacity_tokens=4_000)


def test_a_size_known_exactly_gets_the_exact_boost():
    for size in (0.01, 2.0, 30.0):
        assert boost_from_excess(math.expm1(GAMMA * size), GAMMA) == pytest.approx(boost_s(size, GAMMA), rel=1e-12)
    assert boost_s(1e9, GAMMA) < 1e-300 and excess_exponent(1e9, GAMMA) == 700.0  # no overflow
    assert excess_exponent(0.0, GAMMA) > 0  # a size of 0 keeps a finite boost


def test_labels_are_bands_of_powers_of_two_and_areas_grow_with_the_kv():
    assert [label_of(n) for n in (0, 1, 2, 3, 4, 7, 8)] == [1, 1, 2, 2, 3, 3, 4]
    assert segment_area(100, 4) == 4 * 100 + 10  # the KV held grows by one token a step


def _observe(labels, times, context, predicted, realized):
    for _ in range(times):
        labels.observe(context, predicted, realized)


def test_a_label_learns_the_spread_of_its_predictions():
    labels = SizeLabels()
    exact = math.expm1(GAMMA * 3.0)
    _observe(labels, MIN_SAMPLES - 1, 100, 40, 80)
    assert labels.samples(40) == MIN_SAMPLES - 1 and labels.excess(3.0, 40, GAMMA) == pytest.approx(exact)
    labels.observe(100, 40, 10)
    ratios = [segment_area(100, 80) / segment_area(100, 40)] * (MIN_SAMPLES - 1) + [
        segment_area(100, 10) / segment_area(100, 40)]
    want = sum(math.expm1(GAMMA * 3.0 * r) for r in ratios) / len(ratios)
    assert labels.excess(3.0, 40, GAMMA) == pytest.approx(want)
    assert labels.excess(3.0, 33, GAMMA) == pytest.approx(want)  # same band
    assert labels.excess(3.0, 64, GAMMA) == pytest.approx(exact)  # another band learnt nothing
    labels.observe(100, 40, 40)  # a new segment is read, not a stale copy
    assert labels.excess(3.0, 40, GAMMA) == pytest.approx((want * MIN_SAMPLES + exact) / (MIN_SAMPLES + 1))


def test_spread_predictions_get_less_boost_than_their_mean_and_only_the_newest_count():
    labels = SizeLabels()
    # Half twice the predicted area, half none: the mean ratio is 1, the spread is not.
    predicted = 40
    double = next(n for n in range(predicted, 400) if segment_area(0, n) >= 2 * segment_area(0, predicted))
    _observe(labels, WINDOW, 0, predicted, double)
    _observe(labels, WINDOW // 2, 0, predicted, 0)  # the oldest half ages out
    assert labels.samples(predicted) == WINDOW
    ratio = segment_area(0, double) / segment_area(0, predicted)
    mean = (WINDOW // 2) * (ratio + 0) / WINDOW
    assert boost_from_excess(labels.excess(3.0, predicted, GAMMA), GAMMA) < boost_s(3.0 * mean, GAMMA)
    assert labels.excess(3.0, predicted, GAMMA) > 0  # a ratio of 0 still leaves a finite boost


def _finish(policy, predicted, realized, rid):
    """A one-segment request predicted at `predicted` tokens that generated `realized`."""
    request = build_request(rid, 300, [(realized, None)], 1.0)
    progress = RequestProgress(request, order_s=1.0)
    policy.start_segment(progress, LOAD)
    progress.predictions = [replace(progress.predictions[0], output_tokens=predicted)]
    policy.observe_finish(progress)


def test_mars_boost_label_ranks_as_mars_boost_until_a_label_learns_then_boosts_less():
    label = make_policy("mars-boost-label", COST, boost_gamma=GAMMA)
    plain = make_policy("mars-boost", COST, boost_gamma=GAMMA)
    assert label.size_labels is not None and plain.size_labels is None and not label.starvation.enabled
    request = build_request("q", 300, [(40, ApiCall(ApiType.TOOL, 1.0, 20)), (30, None)], 2.0)
    ours, theirs = RequestProgress(request, order_s=2.0), RequestProgress(request, order_s=2.0)
    label.start_segment(ours, LOAD)
    plain.start_segment(theirs, LOAD)
    assert label.queue_key(ours, LOAD) == pytest.approx(plain.queue_key(theirs, LOAD))
    for i in range(MIN_SAMPLES):  # segments predicted in 40's band ran four times as long
        _finish(label, 40, 160, f"f{i}")
    assert label.size_labels.samples(40) == MIN_SAMPLES
    size_s = label.device_size_s(ours, LOAD)
    assert label.queue_key(ours, LOAD) > plain.queue_key(theirs, LOAD) > boost_key(2.0, 0.0, GAMMA)
    assert plain.queue_key(theirs, LOAD) == pytest.approx(boost_key(2.0, size_s, GAMMA))


def test_a_call_ends_a_segment_the_labels_learn_from():
    policy = make_policy("mars-boost-label", COST, boost_gamma=GAMMA)
    request = build_request("c", 300, [(40, ApiCall(ApiType.TOOL, 1.0, 20)), (50, None)], 2.0)
    progress = RequestProgress(request, order_s=2.0)
    policy.start_segment(progress, LOAD)
    progress.segment_index = 1
    policy.start_segment(progress, LOAD)
    assert policy.size_labels.samples(40) == 1
    policy.observe_finish(progress)
    assert policy.size_labels.samples(50) == 2  # 40 and 50 share a band


def test_size_labels_go_with_the_boost_order_only():
    with pytest.raises(ValueError, match="size labels go with the BOOST order"):
        replace(make_policy("mars", COST), size_labels=SizeLabels())


def test_edges_a_prediction_of_nothing_a_reply_of_nothing_and_a_huge_size():
    zero = SizeLabels()
    _observe(zero, MIN_SAMPLES, 100, 0, 1)  # a prediction of 0 tokens is priced as 1: here R = 1
    assert zero.excess(3.0, 0, GAMMA) == pytest.approx(math.expm1(GAMMA * 3.0))
    none = SizeLabels()
    _observe(none, MIN_SAMPLES, 100, 40, 0)  # nothing generated: R = 0, the smallest size's excess
    assert none.excess(3.0, 40, GAMMA) == pytest.approx(math.expm1(excess_exponent(0.0, GAMMA)))
    long = SizeLabels()
    _observe(long, MIN_SAMPLES, 100, 40, 160)  # R > 1
    assert math.isfinite(long.excess(1e9, 40, GAMMA))  # no overflow on a huge size
