"""A steady stream of short requests and one long one, with and without starvation prevention."""

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


def _long_finish(threshold):
    policy = make_policy("mars", COST, starvation_threshold=threshold)
    result = Simulator(_workload(), small_profile(device_blocks=48, host_blocks=16), policy).run()
    record = next(r for r in result.records if r.request_id == "long")
    assert len(result.records) == len(_workload())  # the run drains: everything finishes
    return record


def test_long_request_finishes_during_the_stream_with_prevention():
    record = _long_finish(100)
    assert record.finish_s < STREAM_END_S / 2


def test_long_request_waits_for_the_stream_to_end_without_prevention():
    with_prevention = _long_finish(100)
    without = _long_finish(None)
    assert without.finish_s >= STREAM_END_S * 0.9
    assert without.e2e_s > 5 * with_prevention.e2e_s


@pytest.mark.parametrize("threshold", [10, 1000])
def test_threshold_sets_how_long_it_waits(threshold):
    assert _long_finish(threshold).max_wait_s <= _long_finish(None).max_wait_s
