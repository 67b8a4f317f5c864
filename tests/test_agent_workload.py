"""The synthetic long-context agent workload: determinism, documented bounds, the bundled sample."""

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.workload import AgentWorkloadParams, ApiType, agent_requests, load_trace
from marsched.workload.agent import BUNDLED_COUNT, BUNDLED_SEED

REPO = Path(__file__).resolve().parents[1]
BUNDLED_COPIES = (REPO / "data" / "workloads" / "agent_long_context.jsonl",
                  REPO / "src" / "marsched" / "workload" / "data" / "agent_long_context.jsonl")
GPTJ_KV_TOKENS = 52_096  # the simulator's GPT-J profile: a request's final context + 1 must fit


@pytest.fixture(scope="module")
def many():
    return agent_requests(3000, seed=7)


def test_same_seed_same_requests_and_another_seed_others():
    assert agent_requests(50, seed=3) == agent_requests(50, seed=3)
    assert agent_requests(50, seed=3) != agent_requests(50, seed=4)
    assert agent_requests(20, seed=3) == agent_requests(50, seed=3)[:20]  # a request's draws do not depend on n


def test_documented_bounds_hold(many):
    p = AgentWorkloadParams()
    for index, request in enumerate(many):
        assert request.request_id == f"agent-{index}" and request.arrival_s == 0.0
        assert p.prompt_tokens[0] <= request.prompt_tokens <= p.prompt_tokens[1]
        assert 2 <= request.num_calls <= 10
        assert not request.ends_with_call
        *calls, answer = request.segments
        for segment in calls:
            assert segment.api.api_type is ApiType.TOOL
            assert 20 <= segment.output_tokens <= 200
            assert 0.1 <= segment.api.duration_s <= 20.0
            assert segment.api.duration_s == round(segment.api.duration_s, 3)
            assert 20 <= segment.api.return_tokens <= 2000
        assert 50 <= answer.output_tokens <= 1000
        assert request.final_context_tokens <= p.max_context_tokens
        assert request.final_context_tokens + 1 <= GPTJ_KV_TOKENS


def test_shape_is_the_documented_one(many):
    calls = [s for r in many for s in r.segments if s.api is not None]
    assert statistics.median(r.prompt_tokens for r in many) == pytest.approx(3000, rel=0.05)
    assert statistics.median(s.api.duration_s for s in calls) == pytest.approx(1.5, rel=0.1)
    assert statistics.median(s.api.return_tokens for s in calls) == pytest.approx(300, rel=0.1)
    assert statistics.median(r.segments[-1].output_tokens for r in many) == pytest.approx(300, rel=0.1)
    assert {r.num_calls for r in many} == set(range(2, 11))
    # Contexts grow to many thousands of tokens, and the cap is reached now and then.
    assert statistics.mean(r.final_context_tokens for r in many) > 5000
    assert max(r.final_context_tokens for r in many) > 11_500


def test_a_smaller_cap_cuts_calls_and_is_respected():
    params = AgentWorkloadParams(max_context_tokens=8000)
    requests = agent_requests(500, seed=1, params=params)
    assert max(r.final_context_tokens for r in requests) <= 8000
    assert statistics.mean(r.num_calls for r in requests) < statistics.mean(r.num_calls for r in agent_requests(500, seed=1))


@pytest.mark.parametrize("changes", [
    {"prompt_median": 0.0}, {"tool_sigma": -1.0}, {"calls": (5, 2)}, {"result_tokens": (-1, 10)},
    {"tool_duration_s": (2.0, 1.0)}, {"max_context_tokens": 5000},
])
def test_bad_parameters_are_rejected(changes):
    with pytest.raises(ValueError, match="AgentWorkloadParams"):
        AgentWorkloadParams(**changes)


@pytest.mark.parametrize("n", [-1, 2.0, True])
def test_bad_count_is_rejected(n):
    with pytest.raises(ValueError, match="agent_requests"):
        agent_requests(n, seed=0)


def test_the_named_trace_is_the_bundled_sample():
    assert load_trace("agent") == agent_requests(BUNDLED_COUNT, seed=BUNDLED_SEED)
    assert load_trace("agent_long_context") == load_trace(BUNDLED_COPIES[0])


def test_regenerating_the_bundled_file_is_byte_identical(tmp_path):
    out = tmp_path / "agent.jsonl"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "make_agent_trace.py"), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for copy in BUNDLED_COPIES:
        assert out.read_bytes() == copy.read_bytes(), copy


def test_a_short_simulation_finishes_every_request():
    record = run_one(RunSpec(policy="mars", qps=1.0, trace="agent", duration_s=20))
    assert record["num_requests"] > 5
    assert record["num_finished"] == record["num_requests"]
