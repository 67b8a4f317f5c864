"""Both engines run one call lifecycle (`marsched.lifecycle`): the same scripted request stream
gives the same sequence of lifecycle events per request in the simulator and in real vLLM.

Four augmented requests (two calls each) and two plain ones arrive together, with memory to
spare (no preemption), under each policy whose strategy does not depend on the engine's load
(the fixed ones, and stock vLLM's discard at every call): what each engine decides and when it
tells it must then agree event for event. Times, token counts and the engine-wide events
(`schedule`) are the engines' own and are not compared.
"""

from __future__ import annotations

import pytest

from marsched.metrics.trace import EventTrace
from marsched.policy import make_policy
from marsched.sim.engine import Simulator
from marsched.workload import ApiCall, ApiType, build_request
from lifecycle_parity_run import POLICIES, RETURN_TOKENS
from lifecycle_parity_run import script as _script
from simhelpers import COST, small_profile

# What an event says of the request's lifecycle, beyond its kind (not times or token counts).
SHARED_FIELDS = ("segment", "queue", "strategy", "reason", "where")


class _Recorder(EventTrace):
    enabled = True

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event, t, rid=None, **fields):
        self.events.append({"event": event, "rid": rid, **fields})


def lifecycle(events: list[dict]) -> dict[str, list[tuple]]:
    """Each request's events, as (kind, shared fields)."""
    per_request: dict[str, list[tuple]] = {}
    for e in events:
        if e.get("rid") is None:
            continue
        per_request.setdefault(e["rid"], []).append((e["event"], *(e.get(f) for f in SHARED_FIELDS)))
    return per_request


def simulated(policy: str) -> dict[str, list[tuple]]:
    requests = [build_request(rid, prompt, [(n, ApiCall(ApiType.OTHER, s, RETURN_TOKENS) if s else None)
                                            for n, s in parts], 0.0)
                for rid, prompt, parts in _script()]
    trace = _Recorder()
    Simulator(requests, small_profile(device_blocks=256, host_blocks=256), make_policy(policy, COST),
              trace=trace).run()
    return lifecycle(trace.events)


def test_the_simulator_lifecycle_of_a_swapped_call():
    """The shape both engines must show, spelled out once for Swap."""
    events = simulated("swap")["aug-0"]
    kinds = [e[0] for e in events]
    assert kinds == ["arrive", "predict", "assign_strategy", "admit",
                     "api_start", "swap_out", "api_end", "predict", "assign_strategy", "resume", "admit", "swap_in",
                     "api_start", "swap_out", "api_end", "predict", "resume", "admit", "swap_in", "finish"]
    assert [e[5] for e in events if e[0] == "resume"] == ["host", "host"]


@pytest.mark.vllm
def test_both_engines_tell_the_same_lifecycle(parity_run):
    from marsched.metrics.trace import read_trace
    from vllm_scenarios import ended_trace

    ran = parity_run.last
    assert ran.returncode == 0, ran.stderr[-3000:]
    for policy in POLICIES:
        trace = parity_run.folder / "traces" / f"{policy}.jsonl"
        events = ended_trace(trace)
        assert read_trace(trace)[-1]["event"] == "end"
        real, sim = lifecycle(events), simulated(policy)
        assert real.keys() == sim.keys(), policy
        for rid in sim:
            assert real[rid] == sim[rid], f"{policy} {rid}:\nvllm {real[rid]}\nsim  {sim[rid]}"
