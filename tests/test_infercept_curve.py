"""scripts/infercept_curve.py (marsched.experiments.infercept_curve): where a normalized-latency curve
crosses its knee thresholds."""

from __future__ import annotations

import pytest

from marsched.experiments import infercept_curve


@pytest.fixture(scope="module")
def curve():
    return infercept_curve


def test_the_crossing_is_interpolated_between_the_rates_around_it(curve):
    points = [(1.0, 20.0), (1.5, 30.0), (2.0, 60.0)]
    assert curve.interpolated_crossing(points, 40.0) == pytest.approx(1.5 + 0.5 * (10 / 30))
    assert curve.interpolated_crossing(list(reversed(points)), 25.0) == pytest.approx(1.25)  # order does not matter
    assert curve.interpolated_crossing(points, 100.0) is None
    assert curve.interpolated_crossing(points, 10.0) == 1.0  # already above at the first rate


def test_knees_are_multiples_of_the_value_at_one_request_per_second(curve):
    points = [(1.0, 19.0), (1.5, 30.0), (2.0, 113.0)]
    knees = curve.knees(points)
    assert knees["2x"] == pytest.approx(1.5 + 0.5 * (38 - 30) / (113 - 30))
    assert curve.knees([(1.2, 20.0), (2.0, 50.0)]) == {key: None for key in knees}  # no light-load point


def test_a_variant_over_seeds_averages_the_curve_and_keeps_each_seeds_knee(curve):
    def record(policy, seed, qps, norm_ms):
        return {"profile": "gptj-6b-a100:bundled", "policy": policy, "seed": seed, "qps": qps,
                "norm_latency_mean_s_per_token": norm_ms / 1000, "e2e_mean_s": 1.0, "preemptions": 0,
                "strategy_counts": {}, "num_finished": 1}

    records = []
    for policy in curve.POLICIES:
        records += [record(policy, 0, 1.0, 20.0), record(policy, 0, 2.0, 60.0), record(policy, 0, 3.0, 200.0),
                    record(policy, 1, 1.0, 20.0), record(policy, 1, 2.0, 30.0)]  # seed 1 stopped before 3 req/s
    published = {p: curve.knees(curve.PUBLISHED[p]) for p in curve.POLICIES}
    variant = curve._variant_result(records, "bundled", {}, "", [0, 1], published)
    points = variant["curves"]["vllm"]
    assert [(p["qps"], p["norm_ms_per_token"]) for p in points] == [(1.0, 20.0), (2.0, 45.0)]  # rates both reached
    assert variant["knees_by_seed"]["vllm"]["0"]["2x"] == pytest.approx(1.5)
    assert variant["knees_by_seed"]["vllm"]["1"]["2x"] is None
    assert variant["knees"]["vllm"]["2x"] == pytest.approx(1.0 + 20 / 25)  # 40 ms crossed on the mean curve
