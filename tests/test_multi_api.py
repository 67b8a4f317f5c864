"""The published INFERCEPT multi-API mixture: trailing calls, negative returns, labels, and a simulated run."""

import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.workload import (
    ApiCall,
    ApiType,
    TraceError,
    TraceWarning,
    build_request,
    load_infercept_json,
    load_jsonl,
    load_trace,
    parse_infercept_json,
    save_jsonl,
)

MULTI = Path(__file__).resolve().parents[1] / "data" / "workloads" / "infercept_multi_api.json"
CLAMPED = {"7_2", "13_2", "16_2", "25"}  # their last segment's api_token_length is -2


def _load(*args, **kwargs):
    """Load and return (requests, the TraceWarnings emitted), every warning shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        requests = load_trace(*args, **kwargs)
    return requests, [w.message for w in caught if issubclass(w.category, TraceWarning)]


@pytest.fixture(scope="module")
def loaded():
    return _load("multi")


@pytest.fixture(scope="module")
def requests(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def raw():
    return json.loads(MULTI.read_text())


def test_loads_as_published(requests, raw):
    assert len(requests) == 397
    assert [r.request_id for r in requests] == list(raw)
    calls = [r.num_calls for r in requests]
    assert (min(calls), max(calls)) == (1, 16)
    assert sum(calls) == 1841  # mean 4.64
    # A request has a call on every segment that has api_time, and only there.
    for request in requests:
        has_time = ["api_time" in segment for segment in raw[request.request_id]]
        assert [s.api is not None for s in request.segments] == has_time, request.request_id


def test_184_requests_end_with_a_call(requests, raw):
    trailing = [r for r in requests if r.ends_with_call]
    assert len(trailing) == 184
    assert {r.request_id for r in trailing} == {rid for rid, segments in raw.items() if "api_time" in segments[-1]}
    for request in trailing:
        last = request.segments[-1]
        # The KV cache computed is the context at the call; the return is never prefilled.
        assert request.final_context_tokens == last.context_tokens + last.output_tokens


def test_negative_returns_are_read_as_zero_with_one_warning(loaded, raw):
    requests, caught = loaded
    assert len(caught) == 1
    warning = caught[0]
    assert warning.field == "api_token_length"
    assert len(warning.records) == 4
    assert warning.records[0] == "request '7_2' segment 5 (-2)"
    message = str(warning)
    assert message.startswith(f"{warning.path}: 4 segments with field 'api_token_length'")
    assert "infercept_multi_api.json" in warning.path
    assert "request '7_2' segment 5" in message and "and 1 more" in message
    by_id = {r.request_id: r for r in requests}
    for request_id in CLAMPED:
        assert raw[request_id][-1]["api_token_length"] == -2
        assert by_id[request_id].segments[-1].api.return_tokens == 0


def test_strict_rejects_a_negative_return_naming_file_request_segment_and_field():
    with pytest.raises(TraceError) as caught:
        load_trace(MULTI, strict=True)
    error = caught.value
    assert (error.path, error.record, error.field) == (str(MULTI), "request '7_2' segment 5", "api_token_length")
    assert "-2" in error.problem
    assert str(error).startswith(f"{MULTI}: request '7_2' segment 5: field 'api_token_length': ")
    with pytest.raises(TraceError, match="api_token_length"):
        load_trace("multi", strict=True)
    with pytest.raises(TraceError, match="api_token_length"):
        load_infercept_json(MULTI, strict=True)


def test_a_negative_return_mid_request_is_read_as_zero():
    # The later prompt_tokens (11) is checked against the file's own numbers (10 + 2 - 1);
    # our contexts then use the return as read, 0.
    content = json.dumps({"r": [
        {"prompt_tokens": 10, "completion_tokens": 2, "api_time": 0.5, "api_token_length": -1},
        {"prompt_tokens": 11, "completion_tokens": 3},
    ]})
    with pytest.warns(TraceWarning, match="1 segment with field 'api_token_length'"):
        (request,) = parse_infercept_json(content, source="t.json")
    assert request.segments[0].api.return_tokens == 0
    assert request.segments[1].context_tokens == 12
    with pytest.raises(TraceError, match="request 'r' segment 0: field 'api_token_length'"):
        parse_infercept_json(content, source="t.json", strict=True)


def test_a_clean_file_warns_nothing():
    _, caught = _load("single")
    assert caught == []


def test_a_last_call_of_no_time_and_no_return_is_no_call(tmp_path):
    trace = tmp_path / "z.json"
    trace.write_text(json.dumps({"r": [
        {"prompt_tokens": 10, "completion_tokens": 2, "api_time": 0, "api_token_length": 0},
        {"prompt_tokens": 12, "completion_tokens": 3, "api_time": 0, "api_token_length": 0},
    ]}))
    (request,) = load_trace(trace)
    assert request.segments[0].api == ApiCall(ApiType.MATH, 0.0, 0)  # between segments it still splits them
    assert request.segments[1].api is None and not request.ends_with_call


def test_calls_per_type(requests):
    counts = Counter(s.api.api_type for r in requests for s in r.segments if s.api is not None)
    assert counts == {
        ApiType.MATH: 283,
        ApiType.VE: 289,
        ApiType.QA: 144,
        ApiType.CHATBOT: 675,
        ApiType.TTS: 225,
        ApiType.IMAGE: 225,
    }
    assert ApiType.OTHER not in counts


def test_text_records_alternate_instruction_calls_and_chat_turns(requests, raw):
    by_id = {r.request_id: r for r in requests}
    for request_id, instruction, labelled in (("0_1", "Convert this to text to speech.", ApiType.TTS),
                                             ("0_3", "Generate an image about this.", ApiType.IMAGE)):
        for segment, source in zip(by_id[request_id].segments, raw[request_id]):
            expected = labelled if source["api_token"].strip() == instruction else ApiType.CHATBOT
            assert segment.api.api_type is expected


def test_trailing_calls_round_trip_through_jsonl(requests, tmp_path):
    path = save_jsonl(requests, tmp_path / "multi.jsonl")
    assert load_jsonl(path) == requests
    line = json.loads(path.read_text().splitlines()[[r.request_id for r in requests].index("7_2")])
    assert line["segments"][-1]["api"]["return_tokens"] == 0
    # Built by hand too: a trailing call survives a save and a load.
    request = build_request("t", 5, [(2, ApiCall(ApiType.QA, 0.5, 3)), (4, ApiCall(ApiType.TTS, 1.0, 9))])
    assert request.ends_with_call and request.num_calls == 2
    assert load_jsonl(save_jsonl([request], tmp_path / "t.jsonl")) == [request]


@pytest.mark.filterwarnings("ignore::marsched.workload.errors.TraceWarning")
def test_a_short_simulation_finishes_every_request():
    record = run_one(RunSpec(policy="infercept", qps=1.0, trace="multi", duration_s=20))
    assert record["num_requests"] > 5
    assert record["num_finished"] == record["num_requests"]


def test_cli_prints_the_warning_once_and_strict_fails(tmp_path):
    # A trace with a negative return but no trailing call; compare reloads it in each worker.
    trace = tmp_path / "neg.json"
    trace.write_text(json.dumps({
        "a": [{"prompt_tokens": 50, "completion_tokens": 5, "api_time": 0.1, "api_token_length": -2},
              {"completion_tokens": 5}],
        "b": [{"prompt_tokens": 60, "completion_tokens": 5, "api_time": 0.2, "api_token_length": 4},
              {"completion_tokens": 5}],
    }))
    env = {**os.environ, "COLUMNS": "200"}
    command = [sys.executable, "-m", "marsched.cli", "compare", "--trace", str(trace), "--policies", "mars,vllm",
               "--qps", "2", "--duration", "5", "--workers", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("TraceWarning") + run.stderr.count("warning:") == 1, run.stderr
    assert "1 segment with field 'api_token_length'" in run.stderr
    strict = subprocess.run([*command, "--strict"], capture_output=True, text=True, timeout=300, env=env)
    assert strict.returncode == 2
    assert "request 'a' segment 0" in strict.stderr and "api_token_length" in strict.stderr
