"""vLLM's victim read (`running[-1]`, then `running.pop()`) on the plugin's `RunningOrder` gives the
lifecycle's victim: the lowest-ranked unprotected running request, or the requester itself."""

from marsched.vllm.running_order import RunningOrder


def _order(names, protected=(), keys=None):
    keys = keys or {n: float(i) for i, n in enumerate(names)}
    return RunningOrder(list(names), lambda r: r in protected, keys.__getitem__)


def _vllm_preempts_for(running, index):
    """What vLLM's FCFS scheduler does when `running[index]` cannot grow: read the victim, pop it."""
    requester = running[index]
    victim = running[-1]
    popped = running.pop()
    assert popped is victim
    return requester, victim


def test_the_lowest_ranked_unprotected_request_is_the_victim():
    running = _order(["a", "b", "c"], keys={"a": 1.0, "b": 9.0, "c": 5.0})
    assert _vllm_preempts_for(running, 0) == ("a", "b")  # the highest key, wherever it stands
    assert list(running) == ["a", "c"]


def test_protected_requests_are_passed_over():
    running = _order(["a", "b", "c"], protected={"c"})
    assert _vllm_preempts_for(running, 0) == ("a", "b")


def test_when_every_request_is_protected_the_requester_is_the_victim():
    running = _order(["a", "b", "c"], protected={"a", "b", "c"})
    assert _vllm_preempts_for(running, 1) == ("b", "b")
    assert list(running) == ["a", "c"]


def test_the_requester_unprotected_among_protected_ones_is_its_own_victim():
    running = _order(["a", "b"], protected={"b"})
    assert _vllm_preempts_for(running, 0) == ("a", "a")


def test_a_plain_pop_or_slice_is_a_list_s():
    running = _order(["a", "b", "c"], protected={"a", "b", "c"})
    assert running[0:2] == ["a", "b"]
    assert running.pop() == "c"  # vLLM's reset: preempt everything, last first
    assert running.pop(0) == "a" and list(running) == ["b"]


def test_a_request_scheduled_earlier_in_the_step_is_never_the_victim():
    # Identical requests tie on their keys; vLLM's FCFS path cannot unschedule a victim it already
    # scheduled this step (the engine core died on that assertion under a soak).
    running = _order(["a", "b", "c", "d"], keys={"a": 1.0, "b": 5.0, "c": 5.0, "d": 5.0})
    assert _vllm_preempts_for(running, 2) == ("c", "d")  # of the tie at or after the requester, the last
    running = _order(["a", "b", "c"], keys={"a": 1.0, "b": 7.0, "c": 3.0})
    assert _vllm_preempts_for(running, 2) == ("c", "c")  # b was scheduled before c: not a candidate
    running = _order(["a", "b", "c"], protected={"c"}, keys={"a": 1.0, "b": 7.0, "c": 3.0})
    assert _vllm_preempts_for(running, 2) == ("c", "c")  # every candidate protected: the requester
