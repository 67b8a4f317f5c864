"""The lifecycle driver's own rules, on a stand-in engine: the protection an admission states,
the trailing call's start, and the victim on a tie."""

from __future__ import annotations

import pytest

from marsched.lifecycle import CallLifecycle, choose_victim
from marsched.policy import EngineLoad, RequestProgress, make_policy
from marsched.sim.request import SimRequest
from simhelpers import COST, single, two_segment
from test_lifecycle_parity import _Recorder


class _Engine:
    """Clock, iteration and load for the driver; no blocks move."""

    def __init__(self) -> None:
        self.now, self.iteration = 5.0, 40

    def clock(self):
        return self.now

    def current_iteration(self):
        return self.iteration

    def load(self):
        return EngineLoad(self.now, 0, 0.01, 10**9)

    def kv_blocks_in_use(self):
        return 0, 0


def _driver(policy):
    trace = _Recorder()
    queue = type("Q", (), {"threshold": lambda self, now: None, "head_key": lambda self: None,
                           "__len__": lambda self: 0})()
    return CallLifecycle(policy, queue, _Engine(), trace, handle_of=lambda rid: None), trace


def _started(policy, request):
    handle = SimRequest(RequestProgress(request, order_s=0.0))
    policy.start_segment(handle.progress, EngineLoad(0.0, 0, 0.01, 10**9))
    return handle


@pytest.mark.parametrize("quantum, stated", [(0, None), (1, 41), (30, 70)])
def test_an_admission_states_the_protection_it_leaves(quantum, stated):
    policy = make_policy("mars", COST, starvation="iterations", starvation_threshold=5, starvation_quantum=quantum)
    driver, trace = _driver(policy)
    promoted, plain = _started(policy, single("p", 0.0, 10, 5)), _started(policy, single("q", 0.0, 10, 5))
    promoted.progress.promoted = True
    driver.admitted(promoted, 10)
    driver.admitted(plain, 10)
    admits = {e["rid"]: e for e in trace.events if e["event"] == "admit"}
    assert admits["p"]["protected_until"] == stated  # the first iteration it may be preempted again
    assert admits["q"]["protected_until"] is None and admits["q"]["protected_segment"] is None


def test_a_trailing_call_starts_the_call_clock():
    policy = make_policy("mars", COST)
    driver, trace = _driver(policy)
    handle = _started(policy, two_segment("t", 0.0, 10, 3, 0.5, 2, 1))
    driver.start_trailing_call(handle, 13, 0.5)
    assert handle.progress.api_started_s == 5.0
    assert [(e["event"], e["strategy"]) for e in trace.events] == [("api_start", None)]


def test_the_victim_on_a_tie_is_the_first_unprotected_request():
    running = ["a", "b", "c"]
    assert choose_victim(running, "r", lambda r: r == "a", lambda r: 1.0) == "b"
