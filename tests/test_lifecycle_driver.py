"""The lifecycle driver's own rules, on a stand-in engine: the protection an admission states,
the trailing call's start, the victim on a tie, and the revisit of paused calls (a released one, a fault)."""

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


class _Reconsidering:
    """A policy whose revisit of a paused call asks nothing of the engine: it keeps the call
    (None), or fails for the request named `failing`; it records whom it was asked about."""

    def __init__(self, policy, failing: str) -> None:
        self._policy, self.failing, self.asked = policy, failing, []

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def reconsider(self, progress, load):
        self.asked.append(progress.request_id)
        if progress.request_id == self.failing:
            raise RuntimeError("bad estimate")
        return None


class _HoldingEngine(_Engine):
    """Still holds every preserved request's blocks but those named in `released`."""

    def __init__(self, released: set[str]) -> None:
        super().__init__()
        self.released = released

    def holds_preserved(self, handle):
        return handle.progress.request_id not in self.released


def _reconsidering(on_fault):
    policy = _Reconsidering(make_policy("infercept", COST), failing="bad")
    queue = type("Q", (), {"threshold": lambda self, now: None})()
    driver = CallLifecycle(policy, queue, _HoldingEngine({"gone"}), _Recorder(), handle_of=lambda rid: None,
                           on_fault=on_fault)
    handles = {rid: _started(policy, two_segment(rid, 0.0, 10, 3, 0.5, 2, 1)) for rid in ("gone", "bad", "ok")}
    driver.paused_preserved.update(handles)  # in this order: the released one first
    return driver, policy, handles


def test_revisiting_paused_calls_drops_released_ones_and_a_fault_ends_only_its_request():
    faults = []
    driver, policy, handles = _reconsidering(lambda handle, error, where: faults.append((handle, str(error), where)))
    driver.reconsider_paused()
    assert policy.asked == ["bad", "ok"]  # past the released one, and past the fault
    assert driver.paused_preserved == {"ok": handles["ok"]}
    assert faults == [(handles["bad"], "bad estimate", "reconsidering a paused request")]


def test_revisiting_paused_calls_without_a_fault_handler_raises():
    driver, policy, _ = _reconsidering(None)
    with pytest.raises(RuntimeError, match="bad estimate"):
        driver.reconsider_paused()
    assert policy.asked == ["bad"]
