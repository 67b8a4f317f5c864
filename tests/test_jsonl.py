"""marsched JSONL: round trips, atomic saves, and the documented examples."""

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import marsched.workload.jsonl as jsonl
from marsched.workload import (
    ApiCall,
    ApiType,
    build_request,
    load_jsonl,
    load_trace,
    parse_jsonl,
    poisson_arrivals,
    save_jsonl,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"

calls = st.builds(
    ApiCall,
    st.sampled_from(list(ApiType)),
    st.floats(min_value=0, max_value=1e4, allow_nan=False, allow_infinity=False),
    st.integers(min_value=0, max_value=10**6),
)


@st.composite
def requests(draw):
    outputs = draw(st.lists(st.integers(0, 10**5), min_size=1, max_size=5))
    apis = [draw(calls) for _ in outputs[:-1]] + [draw(st.none() | calls)]  # the last may be a trailing call
    ids = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=1))
    arrival = draw(st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False))
    return build_request(ids[0], draw(st.integers(0, 10**5)), list(zip(outputs, apis)), arrival)


@settings(max_examples=60, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=6, unique_by=lambda r: r.request_id))
def test_round_trip_is_exact(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    save_jsonl(batch, path)
    assert load_jsonl(path) == batch


def test_bundled_trace_round_trips(tmp_path):
    original = load_trace("bundled")
    path = save_jsonl(original, tmp_path / "bundled.jsonl")
    assert load_jsonl(path) == original
    assert len(path.read_text().splitlines()) == 397


def test_sampled_stream_keeps_arrivals_and_template_ids(tmp_path):
    stream = poisson_arrivals(load_trace("bundled")[:10], qps=5.0, duration_s=4.0, seed=3)
    loaded = load_jsonl(save_jsonl(stream, tmp_path / "s.jsonl"))
    assert loaded == stream
    assert [r.template_id for r in loaded] == [r.template_id for r in stream]
    assert all(r.template_id and "#" not in r.template_id for r in loaded)


def test_written_line_has_the_documented_shape(tmp_path):
    request = build_request("r1", 392, [(127, ApiCall(ApiType.MATH, 0.0001, 21)), (47, None)])
    path = save_jsonl([request], tmp_path / "one.jsonl")
    assert json.loads(path.read_text()) == {
        "id": "r1",
        "arrival_s": 0.0,
        "prompt_tokens": 392,
        "segments": [
            {"output_tokens": 127, "api": {"type": "math", "duration_s": 0.0001, "return_tokens": 21}},
            {"output_tokens": 47},
        ],
    }


def test_documented_examples_load():
    block = re.search(r"## marsched JSONL.*?```json\n(.*?)```", DOC.read_text(), re.S).group(1)
    loaded = parse_jsonl(block, source="docs")
    assert [r.request_id for r in loaded] == ["r1", "r2"]
    assert loaded[1].num_calls == 2
    assert loaded[1].segments[2].context_tokens == 12 + 40 + 8 + 30 + 9


def test_arrival_defaults_to_zero_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"id": "a", "prompt_tokens": 3, "segments": [{"output_tokens": 1}]}\n\n')
    (request,) = load_jsonl(path)
    assert request.arrival_s == 0.0
    assert request.prompt_tokens == 3
    assert request.num_calls == 0


def _only(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def test_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    good = build_request("a", 1, [(1, None)])
    save_jsonl([good], path)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(jsonl.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_jsonl([build_request("b", 2, [(2, None)])], path)
    assert path.read_bytes() == before
    assert _only(tmp_path) == ["t.jsonl"]


def test_unwritable_values_fail_before_touching_disk(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError):
        save_jsonl([build_request("a", 1, [(1, None)], arrival_s=float("nan"))], path)
    assert _only(tmp_path) == []
    with pytest.raises(ValueError, match="repeated"):
        save_jsonl([build_request("a", 1, [(1, None)]), build_request("a", 2, [(1, None)])], path)
    assert _only(tmp_path) == []


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "t.jsonl"
    save_jsonl([build_request("a", 1, [(1, None)])], path)
    save_jsonl([build_request("b", 2, [(3, None)])], path)
    assert [r.request_id for r in load_jsonl(path)] == ["b"]
    assert _only(tmp_path) == ["t.jsonl"]
