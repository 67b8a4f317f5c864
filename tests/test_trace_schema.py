"""Simulator traces are valid against the shipped schema (`metrics/trace.schema.json`).

The vLLM traces are checked the same way in `test_vllm_audit.py`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from marsched.metrics.trace import SCHEMA_PATH, SCHEMA_VERSION, TraceFile, read_trace
from marsched.policy import POLICY_NAMES, make_policy
from marsched.sim.select import make_simulator
from simhelpers import COST, small_profile
from test_trace_consistency import _workload


def sim_trace(path, policy_name: str, **policy_options) -> list[dict]:
    """The trace file a simulator run of the mixed workload writes (as `--trace-out` would)."""
    trace = TraceFile(path)
    policy = make_policy(policy_name, COST, **policy_options)
    make_simulator(_workload(), small_profile(device_blocks=20, host_blocks=64), policy, trace=trace).run()
    trace.close()
    return read_trace(path)


def schema_errors(events: list[dict]) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    return [f"event {i} ({e.get('event')}): {error.message}"
            for i, e in enumerate(events) for error in validator.iter_errors(e)]


def test_the_schema_is_a_valid_json_schema_of_this_version():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$defs"]["run"]["properties"]["schema_version"] == {"const": SCHEMA_VERSION}


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_simulator_traces_follow_the_schema(policy_name, tmp_path):
    events = sim_trace(tmp_path / "t.jsonl", policy_name)
    assert events[0]["event"] == "run" and events[-1]["event"] == "end"
    assert schema_errors(events) == []


def test_the_schema_rejects_an_event_without_what_the_audit_needs(tmp_path):
    events = sim_trace(tmp_path / "t.jsonl", "mars")
    admit = next(e for e in events if e["event"] == "admit")
    broken = {k: v for k, v in admit.items() if k != "score"}
    assert any("'score' is a required property" in m for m in schema_errors([broken]))
    assert schema_errors([{**admit, "queue": "limbo"}])
