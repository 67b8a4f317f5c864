"""γ-Boost (`mars-boost`) and the slowdown metrics beside p99 latency."""

import math

import numpy as np
import pytest

from marsched.metrics.records import SIZE_BUCKETS, slowdowns
from marsched.policy.boost import boost_key, boost_s
from marsched.policy.load import EngineLoad
from marsched.policy.policy import Order
from marsched.policy.progress import RequestProgress
from marsched.policy.registry import make_policy
from marsched.workload import ApiCall, ApiType, build_request
from simhelpers import COST


def test_the_boost_formula():
    gamma = 0.5
    assert boost_s(2.0, gamma) == pytest.approx(math.log(1 / (1 - math.exp(-1.0))) / gamma)
    assert boost_s(0.01, gamma) > boost_s(1.0, gamma) > boost_s(30.0, gamma) > 0  # smaller, more boost
    assert boost_s(100.0, gamma) < 1e-15  # a large job ranks by its arrival
    assert boost_s(0.0, gamma) < math.inf
    assert boost_key(10.0, 2.0, gamma) == pytest.approx(10.0 - boost_s(2.0, gamma))
    with pytest.raises(ValueError, match="must be > 0"):
        boost_s(1.0, 0.0)


def test_overtaking_is_bounded_by_the_boost_gap():
    # A large job arriving at 0 is passed only by smaller ones that arrive within b(small) - b(large).
    gamma, large, small = 0.2, 50.0, 0.5
    window = boost_s(small, gamma) - boost_s(large, gamma)
    assert boost_key(window * 0.99, small, gamma) < boost_key(0.0, large, gamma)
    assert boost_key(window * 1.01, small, gamma) > boost_key(0.0, large, gamma)


def test_mars_boost_ranks_by_arrival_less_the_boost_of_its_mars_key_in_device_seconds():
    policy = make_policy("mars-boost", COST, boost_gamma=0.05)
    mars = make_policy("mars", COST)
    assert policy.order is Order.BOOST and not policy.starvation.enabled and policy.keys_follow_load
    load = EngineLoad(3.0, 200, 0.02, 1_000, kv_capacity_tokens=4_000)
    request = build_request("b", 300, [(40, ApiCall(ApiType.TOOL, 1.0, 20)), (30, None)], 2.0)
    progress, twin = RequestProgress(request, order_s=2.0), RequestProgress(request, order_s=2.0)
    policy.start_segment(progress, load)
    mars.start_segment(twin, load)
    size_s = mars.queue_key(twin, load) / 4_000
    assert policy.queue_key(progress, load) == pytest.approx(boost_key(2.0, size_s, 0.05))
    with pytest.raises(ValueError, match="KV capacity"):
        policy.queue_key(progress, EngineLoad(3.0, 200, 0.02, 1_000))
    with pytest.raises(ValueError, match="boost γ"):
        make_policy("mars-boost", COST, boost_gamma=-1.0)


def test_slowdowns_by_size():
    isolated = np.arange(1.0, 101.0)  # sizes 1..100
    e2e = isolated * 2
    e2e[-1] = 100 * 50  # the largest waits long
    out = slowdowns(e2e, isolated)
    assert out["slowdown_max"] == 50.0 and out["slowdown_mean"] == pytest.approx((99 * 2 + 50) / 100)
    assert list(out["slowdown_mean_by_size"]) == [f"p{lo}-{hi}" for lo, hi in SIZE_BUCKETS]
    assert out["slowdown_mean_by_size"]["p99-100"] == 50.0 and out["slowdown_mean_by_size"]["p0-50"] == 2.0
    assert 2.0 < out["slowdown_p99"] <= 50.0
    single = slowdowns(np.array([3.0]), np.array([1.0]))
    assert single["slowdown_mean_by_size"]["p0-50"] == 3.0 and single["slowdown_mean_by_size"]["p99-100"] == 3.0


def test_slowdown_buckets_hold_the_requests_of_their_sizes():
    from marsched.metrics.records import _percentile

    isolated = np.arange(1.0, 101.0)  # sizes 1..100, in order
    slowdown = 1.0 + np.arange(100) / 10  # a slowdown of its own per request
    out = slowdowns(isolated * slowdown, isolated)
    by_size = out["slowdown_mean_by_size"]
    for (low, high), key in zip(SIZE_BUCKETS, by_size):
        assert by_size[key] == pytest.approx(slowdown[low:high].mean()), key
    assert out["slowdown_p99"] == pytest.approx(_percentile(slowdown, 99)) and out["slowdown_p99"] < out["slowdown_max"]
    # Three requests: every bucket still holds one (the smallest request for the smaller half).
    small = slowdowns(np.array([2.0, 6.0, 12.0]), np.array([1.0, 2.0, 3.0]))["slowdown_mean_by_size"]
    assert small == {"p0-50": 2.0, "p50-90": 3.0, "p90-99": 4.0, "p99-100": 4.0}
    ten = slowdowns(np.arange(1.0, 11.0) * 2, np.arange(1.0, 11.0))["slowdown_mean_by_size"]
    assert ten["p90-99"] == 2.0  # 9.9% of ten requests rounds to none: the bucket takes the next one


def test_requests_of_equal_size_keep_their_order_in_the_buckets():
    rng = np.random.default_rng(0)
    isolated = rng.integers(1, 4, 200).astype(float)  # many ties
    slowdown = rng.uniform(1.0, 9.0, 200)
    by_size = slowdowns(isolated * slowdown, isolated)["slowdown_mean_by_size"]
    order = np.argsort(isolated, kind="stable")  # ties in arrival order: the same run, the same buckets
    assert by_size["p0-50"] == pytest.approx(slowdown[order[:100]].mean())
