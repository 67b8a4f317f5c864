"""Poisson arrivals: rate, window, determinism, sampling and validation."""

import math
from collections import Counter

import numpy as np
import pytest

from marsched.workload import ApiCall, ApiType, build_request, poisson_arrivals
from marsched.workload.arrivals import poisson_times

TEMPLATES = [
    build_request("a", 10, [(5, ApiCall(ApiType.MATH, 0.001, 3)), (2, None)]),
    build_request("b", 20, [(7, None)]),
    build_request("c", 30, [(1, ApiCall(ApiType.TTS, 4.0, 9)), (4, None)]),
]


def test_same_seed_same_stream_and_other_seeds_differ():
    one = poisson_arrivals(TEMPLATES, qps=3.0, duration_s=50.0, seed=7)
    two = poisson_arrivals(TEMPLATES, qps=3.0, duration_s=50.0, seed=7)
    other = poisson_arrivals(TEMPLATES, qps=3.0, duration_s=50.0, seed=8)
    assert [(r.request_id, r.arrival_s) for r in one] == [(r.request_id, r.arrival_s) for r in two]
    assert [r.arrival_s for r in one] != [r.arrival_s for r in other][: len(one)]


def test_arrivals_are_sorted_inside_the_window():
    stream = poisson_arrivals(TEMPLATES, qps=20.0, duration_s=30.0, seed=1)
    times = [r.arrival_s for r in stream]
    assert times == sorted(times)
    assert all(0.0 < t < 30.0 for t in times)
    assert len(set(times)) == len(times)


def test_rate_and_exponential_gaps():
    qps, duration = 50.0, 200.0
    stream = poisson_arrivals(TEMPLATES, qps=qps, duration_s=duration, seed=0)
    expected = qps * duration
    assert abs(len(stream) - expected) < 5 * math.sqrt(expected)  # Poisson count: sd = sqrt(mean)
    gaps = np.diff([0.0] + [r.arrival_s for r in stream])
    assert gaps.mean() == pytest.approx(1 / qps, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1


def test_templates_are_sampled_with_replacement_and_keep_their_shape():
    stream = poisson_arrivals(TEMPLATES, qps=30.0, duration_s=100.0, seed=2)
    by_id = {t.request_id: t for t in TEMPLATES}
    counts = Counter(r.template_id for r in stream)
    assert set(counts) == {"a", "b", "c"}
    for count in counts.values():
        assert count / len(stream) == pytest.approx(1 / 3, abs=0.03)
    for n, request in enumerate(stream):
        assert request.request_id == f"{request.template_id}#{n}"
        assert request.segments == by_id[request.template_id].segments


def test_resampling_a_stream_keeps_the_original_template():
    first = poisson_arrivals(TEMPLATES, qps=2.0, duration_s=10.0, seed=4)
    again = poisson_arrivals(first, qps=2.0, duration_s=10.0, seed=5)
    assert again
    assert {r.template_id for r in again} <= {"a", "b", "c"}
    assert all(r.request_id.count("#") == 1 for r in again)


def test_gap_chunking_does_not_change_thepoisson_times():
    # Gaps are drawn in chunks; many small chunks must give the same times as one large one.
    small = poisson_times(np.random.default_rng(9), 1.0, 500.0, chunk=4)
    large = poisson_times(np.random.default_rng(9), 1.0, 500.0, chunk=100_000)
    assert len(small) > 400
    assert small.max() < 500.0
    np.testing.assert_allclose(small, large, rtol=1e-12)  # only summation order differs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"qps": 0.0}, "qps"),
        ({"qps": -1.0}, "qps"),
        ({"qps": float("nan")}, "qps"),
        ({"qps": float("inf")}, "qps"),
        ({"duration_s": 0.0}, "duration_s"),
        ({"duration_s": -5.0}, "duration_s"),
        ({"seed": 1.5}, "seed"),
        ({"templates": []}, "no templates"),
    ],
)
def test_validation(kwargs, message):
    arguments = {"templates": TEMPLATES, "qps": 1.0, "duration_s": 10.0, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        poisson_arrivals(**arguments)
