"""Subagents (`Request.spawned_by`) arrive when their parent's call starts in the run.

Times worked by hand with the test engine of `simhelpers` (`t(n) = 10 ms + 0.05 ms·n`).
"""

from __future__ import annotations

import dataclasses

import pytest

from marsched.policy import make_policy
from marsched.sim.select import make_simulator
from marsched.sim.spawns import HeldSpawns
from marsched.workload import ApiCall, ApiType, Spawn, build_request
from simhelpers import COST, single, small_profile


def t(tokens: int) -> float:
    return 0.01 + 5e-5 * tokens


def _spawned(rid, arrival, parent, segment=0, prompt=50, output=3):
    return dataclasses.replace(single(rid, arrival, prompt, output), spawned_by=Spawn(parent, segment))


def _parent(rid="P", arrival=0.0, api_s=2.0):
    # Prefill 100, 3 decodes: the call starts at t(100) + 3·t(1) = 0.04515 s after arrival.
    return build_request(rid, 100, [(4, ApiCall(ApiType.TOOL, api_s, 5)), (2, None)], arrival)


def _arrivals(requests, policy="mars"):
    result = make_simulator(requests, small_profile(device_blocks=64), make_policy(policy, COST)).run()
    return {r.request_id: r.arrival_s for r in result.records}


@pytest.mark.parametrize("policy", ["mars", "vllm", "infercept-code"])
def test_a_subagent_arrives_when_its_parents_call_starts(policy):
    # Recorded 5 s and 5.5 s after time 0; the parent's call starts at 0.01 + 0.04515: both shift
    # by the same amount, so the second keeps its 0.5 s after the first.
    requests = [_parent(arrival=0.01), _spawned("C1", 5.0, "P"), _spawned("C2", 5.5, "P")]
    arrivals = _arrivals(requests, policy)
    start = 0.01 + t(100) + 3 * t(1)
    assert arrivals["C1"] == pytest.approx(start, abs=1e-12)
    assert arrivals["C2"] == pytest.approx(start + 0.5, abs=1e-12)
    assert arrivals["P"] == 0.01


def test_a_subagents_subagent_waits_for_the_subagents_call():
    # C starts at the parent's call (0.04515 s); its own call starts after its prefill of 100 and
    # 3 decodes, alone on the engine but beside the paused parent: 0.04515 + 0.04515.
    child = dataclasses.replace(_parent("C", 9.0), spawned_by=Spawn("P", 0))
    requests = [_parent(), child, _spawned("G", 9.5, "C")]
    arrivals = _arrivals(requests)
    assert arrivals["C"] == pytest.approx(t(100) + 3 * t(1), abs=1e-12)
    assert arrivals["G"] == pytest.approx(2 * (t(100) + 3 * t(1)), abs=1e-12)


def test_a_trailing_call_releases_its_subagents():
    parent = build_request("P", 100, [(4, ApiCall(ApiType.TOOL, 1.0, 0))], 0.0)
    arrivals = _arrivals([parent, _spawned("C", 3.0, "P")])
    assert arrivals["C"] == pytest.approx(t(100) + 3 * t(1), abs=1e-12)


def test_a_later_call_releases_only_its_own():
    parent = build_request("P", 100, [(4, ApiCall(ApiType.TOOL, 1.0, 5)), (2, ApiCall(ApiType.TOOL, 1.0, 5)),
                                      (2, None)], 0.0)
    arrivals = _arrivals([parent, _spawned("C0", 0.5, "P", 0), _spawned("C1", 0.6, "P", 1)])
    first = t(100) + 3 * t(1)
    assert arrivals["C0"] == pytest.approx(first, abs=1e-12)
    assert arrivals["C1"] > first + 1.0  # after the first call's 1 s


def test_held_spawns_refuse_a_missing_parent_or_call():
    with pytest.raises(ValueError, match="'C' is started by 'Q', which is not among the run's requests"):
        HeldSpawns([_parent(), _spawned("C", 1.0, "Q")])
    with pytest.raises(ValueError, match="'C' is started by segment 1 of 'P', which has no such call"):
        HeldSpawns([_parent(), _spawned("C", 1.0, "P", segment=1)])
    with pytest.raises(ValueError, match="segment 5 of 'P'"):
        HeldSpawns([_parent(), _spawned("C", 1.0, "P", segment=5)])
    with pytest.raises(ValueError, match="segment 2 of 'P'"):  # one past the last segment
        HeldSpawns([_parent(), _spawned("C", 1.0, "P", segment=2)])
    trailing = build_request("P", 100, [(4, ApiCall(ApiType.TOOL, 1.0, 0))], 0.0)  # segment -1 would have a call
    with pytest.raises(ValueError, match="segment -1 of 'P'"):
        HeldSpawns([trailing, _spawned("C", 1.0, "P", segment=-1)])


def test_held_spawns_release_once_in_recorded_order():
    spawns = HeldSpawns([_parent(), _spawned("B", 2.0, "P"), _spawned("A", 1.5, "P")])
    assert [r.request_id for r in spawns.roots([_parent(), _spawned("B", 2.0, "P")])] == ["P"]
    released = spawns.release("P", 0, 10.0)
    assert [(r.request_id, r.arrival_s) for r in released] == [("A", 10.0), ("B", 10.5)]
    assert spawns.release("P", 0, 11.0) == []
