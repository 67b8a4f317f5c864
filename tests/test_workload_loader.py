"""Loading the bundled INFERCEPT trace and dispatching trace files by extension."""

import json
from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest

import marsched.workload.infercept_json as infercept_json
from marsched.workload import (
    ApiType,
    TraceError,
    TRACE_NAMES,
    api_type_for_duration,
    api_type_for_id,
    api_type_for_text_call,
    bundled_trace,
    count_tokens,
    load_bundled,
    load_infercept_json,
    load_trace,
    save_jsonl,
)

REPO_DATA = Path(__file__).resolve().parents[1] / "data" / "workloads"
BUNDLED = REPO_DATA / "infercept_single_api.json"


@pytest.fixture(scope="module")
def requests():
    return load_trace("bundled")


@pytest.fixture(scope="module")
def raw():
    return json.loads(BUNDLED.read_text())


def test_bundled_trace_has_397_single_api_requests_in_file_order(requests, raw):
    assert len(requests) == 397
    assert [r.request_id for r in requests] == list(raw)
    assert all(r.num_calls == 1 for r in requests)
    assert all(r.arrival_s == 0.0 for r in requests)


def test_both_encodings_are_read(requests, raw):
    token_ids = {rid for rid, segments in raw.items() if "prompt_tokens" in segments[0]}
    assert len(token_ids) == 202
    assert len(raw) - len(token_ids) == 195
    token_types = {ApiType.MATH, ApiType.VE, ApiType.QA}
    for request in requests:
        call_type = request.segments[0].api.api_type
        assert (call_type in token_types) == (request.request_id in token_ids), request.request_id


def test_api_type_counts(requests):
    counts = Counter(s.api.api_type for r in requests for s in r.segments if s.api is not None)
    assert counts == {
        ApiType.MATH: 103,
        ApiType.VE: 54,
        ApiType.QA: 45,
        ApiType.CHATBOT: 65,
        ApiType.TTS: 65,
        ApiType.IMAGE: 65,
    }


def test_first_request_matches_the_file(requests):
    first = requests[0]
    assert first.request_id == "0a84bcdff8434b23971032489f44b90a"
    assert first.prompt_tokens == 392
    assert first.segments[0].output_tokens == 127
    assert first.segments[0].api.api_type is ApiType.MATH
    assert first.segments[0].api.duration_s == pytest.approx(8.662702748551965e-05)
    assert first.segments[0].api.return_tokens == 21
    assert first.segments[1].context_tokens == 540
    assert first.segments[1].output_tokens == 47
    assert first.segments[1].api is None


def test_contexts_accumulate_and_agree_with_the_file(requests, raw):
    for request in requests:
        for before, after in zip(request.segments, request.segments[1:]):
            assert after.context_tokens == before.context_tokens + before.output_tokens + before.api.return_tokens
        segments = raw[request.request_id]
        if "prompt_tokens" in segments[0]:
            assert [s.context_tokens for s in request.segments] == [s["prompt_tokens"] for s in segments]


def test_text_records_are_counted_with_the_gpt2_tokenizer(requests, raw):
    request = next(r for r in requests if r.request_id == "98_2")
    first, last = raw["98_2"]
    assert request.prompt_tokens == count_tokens(first["prompt"])
    assert request.segments[0].output_tokens == count_tokens(first["completion"])
    assert request.segments[0].api.return_tokens == count_tokens(first["api_token"])
    assert request.segments[0].api.api_type is ApiType.IMAGE
    assert request.segments[1].output_tokens == count_tokens(last["completion"])


def test_later_prompts_are_not_tokenized(tmp_path, monkeypatch):
    seen: list[str] = []
    real = infercept_json.count_tokens_batch

    def recording(texts):
        seen.extend(texts)
        return real(texts)

    monkeypatch.setattr(infercept_json, "count_tokens_batch", recording)
    trace = tmp_path / "t.json"
    segments = [
        {"prompt": "Hi", "completion": " there", "api_time": 2.0, "api_token": " ok"},
        {"prompt": "LATER PROMPT", "completion": " bye"},
    ]
    trace.write_text(json.dumps({"7": segments}))
    (request,) = load_infercept_json(trace)
    assert "LATER PROMPT" not in seen
    assert set(seen) == {"Hi", " there", " ok", " bye"}
    assert request.segments[1].context_tokens == count_tokens("Hi") + count_tokens(" there") + count_tokens(" ok")


def test_zero_duration_call_is_a_call(requests, tmp_path):
    zero = [r for r in requests if r.segments[0].api.duration_s == 0.0]
    assert len(zero) == 5
    assert all(r.segments[0].api.api_type is ApiType.MATH for r in zero)
    trace = tmp_path / "z.json"
    trace.write_text(json.dumps({"r": [
        {"prompt_tokens": 10, "completion_tokens": 2, "api_time": 0, "api_token_length": 5},
        {"completion_tokens": 3},
    ]}))
    (request,) = load_trace(trace)
    assert request.segments[0].api.duration_s == 0.0
    assert request.segments[0].api.return_tokens == 5
    assert request.segments[1].context_tokens == 17


def test_multi_call_request_labels_each_call_by_its_duration(tmp_path):
    trace = tmp_path / "m.json"
    trace.write_text(json.dumps({"r": [
        {"prompt_tokens": 10, "completion_tokens": 2, "api_time": 0.0001, "api_token_length": 5},
        {"prompt_tokens": 17, "completion_tokens": 4, "api_time": 0.5, "api_token_length": 6},
        {"completion_tokens": 3},
    ]}))
    (request,) = load_trace(trace)
    assert [s.api.api_type for s in request.segments[:2]] == [ApiType.MATH, ApiType.QA]
    assert request.segments[2].context_tokens == 27


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.0, ApiType.MATH), (0.0099, ApiType.MATH), (0.01, ApiType.VE), (0.1999, ApiType.VE), (0.2, ApiType.QA), (60, ApiType.QA)],
)
def test_duration_thresholds(seconds, expected):
    assert api_type_for_duration(seconds) is expected


@pytest.mark.parametrize(
    ("request_id", "expected"),
    [("17", ApiType.CHATBOT), ("17_1", ApiType.TTS), ("17_2", ApiType.IMAGE), ("17_3", ApiType.IMAGE),
     ("17_4", ApiType.OTHER), ("abc", ApiType.OTHER), ("_1", ApiType.OTHER), ("17_1x", ApiType.OTHER)],
)
def test_id_labels(request_id, expected):
    assert api_type_for_id(request_id) is expected


@pytest.mark.parametrize(
    ("call_text", "request_id", "expected"),
    [("Convert this to text to speech. ", "17_1", ApiType.TTS), ("Generate an image about this. ", "17_3", ApiType.IMAGE),
     ("generate an image about this.", "17_2", ApiType.IMAGE), ("What next?", "17_1", ApiType.CHATBOT),
     ("What next?", "17", ApiType.CHATBOT), ("", "17_3", ApiType.CHATBOT), ("Convert this to text to speech.", "abc", ApiType.TTS),
     ("What next?", "abc", ApiType.OTHER)],
)
def test_text_call_labels(call_text, request_id, expected):
    assert api_type_for_text_call(request_id, call_text) is expected


def test_text_calls_are_labelled_one_by_one(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"4_1": [
        {"prompt": "Hi", "completion": " there", "api_time": 2.0, "api_token": "Convert this to text to speech. "},
        {"completion": " done", "api_time": 20.0, "api_token": " And now?"},
        {"completion": " ok"},
    ]}))
    (request,) = load_trace(trace)
    assert [s.api.api_type for s in request.segments[:2]] == [ApiType.TTS, ApiType.CHATBOT]


@pytest.mark.parametrize("name", ["bundled", "single", "infercept_single_api", "infercept_single_api.json"])
def test_bundled_names(name, requests):
    assert load_trace(name) == requests


def test_trace_names_are_the_short_names():
    assert TRACE_NAMES == ("single", "multi", "agent", "claude-code")


@pytest.mark.parametrize("name", ["mutli", "bundle", "agent.json"])
def test_unknown_name_lists_the_valid_ones(name):
    with pytest.raises(TraceError) as caught:
        load_trace(name)
    message = str(caught.value)
    if name.endswith(".json"):
        assert "no such file" in message  # a path, not a name: the file is looked for
    else:
        assert "unknown trace format" in message
        for valid in ("single", "multi", "agent", "bundled", "infercept_multi_api", "agent_long_context.jsonl"):
            assert valid in message


def test_path_and_packaged_copy_load_the_same(requests):
    assert load_trace(BUNDLED) == requests
    assert load_trace(str(BUNDLED)) == requests
    assert load_bundled() == requests


def test_packaged_data_matches_the_repository_copy():
    packaged = files("marsched.workload") / "data"
    assert (packaged / "infercept_single_api.json").read_bytes() == bundled_trace().read_bytes()
    names = ("infercept_single_api.json", "infercept_multi_api.json", "agent_long_context.jsonl",
             "LICENSE-apache-2.0.txt", "README.md")
    for name in names:
        assert (packaged / name).read_bytes() == (REPO_DATA / name).read_bytes(), name
    # Nothing bundled in one place only: the two folders hold the same files.
    assert sorted(p.name for p in packaged.iterdir()) == sorted(p.name for p in REPO_DATA.iterdir())


def test_jsonl_dispatch(tmp_path, requests):
    path = save_jsonl(requests[:5], tmp_path / "five.JSONL")
    assert load_trace(path) == requests[:5]


@pytest.mark.parametrize("name", ["trace.csv", "trace", "trace.json.gz"])
def test_unknown_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text("{}")
    with pytest.raises(TraceError, match="unknown trace format") as caught:
        load_trace(path)
    assert caught.value.path == str(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TraceError, match="no such file") as caught:
        load_trace(tmp_path / "absent.json")
    assert str(tmp_path / "absent.json") in str(caught.value)
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(folder)
