"""Every malformed trace gives one TraceError that names the file, the record and the field."""

import json
import pickle

import pytest

from marsched.workload import TraceError, load_infercept_json, load_jsonl, load_trace


def _segments(first: dict, last: dict | None = None) -> str:
    return json.dumps({"r": [first, last if last is not None else {"completion_tokens": 3}]})


GOOD_TOKENS = {"prompt_tokens": 10, "completion_tokens": 2, "api_time": 0.5, "api_token_length": 4}
GOOD_TEXT = {"prompt": "Hi", "completion": " there", "api_time": 2.0, "api_token": " ok"}


def _with(base: dict, **changes) -> dict:
    segment = {**base, **changes}
    return {k: v for k, v in segment.items() if v is not _DROP}


_DROP = object()
R0 = "request 'r' segment 0"
R1 = "request 'r' segment 1"

# (case id, file content, record, field, words in the problem)
INFERCEPT_CASES = [
    ("empty", "", "file", None, "empty"),
    ("blank", "  \n\t", "file", None, "empty"),
    ("not json", '{"r": [', "line 1 column 8", None, "not valid JSON"),
    ("not json later line", '{\n"r": [1,]\n}', "line 2 column", None, "not valid JSON"),
    ("top level list", "[1, 2]", "file", None, "top level must be a JSON object"),
    ("top level string", '"x"', "file", None, "got str"),
    ("no requests", "{}", "file", None, "no requests"),
    ("request not a list", '{"r": {"prompt_tokens": 1}}', "request 'r'", None, "list of segments"),
    ("request without segments", '{"r": []}', "request 'r'", None, "no segments"),
    ("segment not an object", '{"r": [7]}', R0, None, "JSON object"),
    ("no prompt at all", _segments(_with(GOOD_TOKENS, prompt_tokens=_DROP)), R0, "prompt_tokens", "missing"),
    ("missing completion", _segments(_with(GOOD_TOKENS, completion_tokens=_DROP)), R0, "completion_tokens", "missing"),
    ("missing api_time", _segments(_with(GOOD_TOKENS, api_time=_DROP)), R0, "api_time", "missing"),
    ("missing api return", _segments(_with(GOOD_TOKENS, api_token_length=_DROP)), R0, "api_token_length", "missing"),
    ("missing last completion", _segments(GOOD_TOKENS, {}), R1, "completion_tokens", "missing"),
    ("string count", _segments(_with(GOOD_TOKENS, completion_tokens="12")), R0, "completion_tokens", "'12' (str)"),
    ("bool count", _segments(_with(GOOD_TOKENS, prompt_tokens=True)), R0, "prompt_tokens", "True (bool)"),
    ("null count", _segments(_with(GOOD_TOKENS, api_token_length=None)), R0, "api_token_length", "None"),
    ("negative count", _segments(GOOD_TOKENS, {"completion_tokens": -3}), R1, "completion_tokens", "non-negative integer"),
    ("fractional count", _segments(_with(GOOD_TOKENS, completion_tokens=3.5)), R0, "completion_tokens", "3.5"),
    ("float count", _segments(_with(GOOD_TOKENS, api_token_length=4.0)), R0, "api_token_length", "4.0 (float)"),
    ("negative api_time", _segments(_with(GOOD_TOKENS, api_time=-1)), R0, "api_time", "-1"),
    ("string api_time", _segments(_with(GOOD_TOKENS, api_time="0.5")), R0, "api_time", "(str)"),
    ("bool api_time", _segments(_with(GOOD_TOKENS, api_time=False)), R0, "api_time", "(bool)"),
    ("nan api_time", _segments(GOOD_TOKENS).replace("0.5", "NaN"), R0, "api_time", "nan"),
    ("infinite api_time", _segments(GOOD_TOKENS).replace("0.5", "Infinity"), R0, "api_time", "inf"),
    ("trailing call without its return", _segments(GOOD_TOKENS, {"completion_tokens": 3, "api_time": 1.0}), R1, "api_token_length", "ends with an API call"),
    ("trailing call without its time", _segments(GOOD_TOKENS, {"completion_tokens": 3, "api_token_length": 2}), R1, "api_time", "missing"),
    ("trailing call with a bad time", _segments(GOOD_TOKENS, {"completion_tokens": 3, "api_time": -1, "api_token_length": 2}), R1, "api_time", "-1"),
    ("text trailing call without its text", _segments(GOOD_TEXT, {"completion": "x", "api_time": 1.0}), R1, "api_token", "missing"),
    ("later prompt disagrees", _segments(GOOD_TOKENS, {"prompt_tokens": 99, "completion_tokens": 3}), R1, "prompt_tokens", "implies 16"),
    ("both encodings", _segments(_with(GOOD_TOKENS, prompt="x")), R0, "prompt", "one encoding"),
    ("text prompt not a string", _segments(_with(GOOD_TEXT, prompt=5), {"completion": "x"}), R0, "prompt", "must be a string"),
    ("text missing api_token", _segments(_with(GOOD_TEXT, api_token=_DROP), {"completion": "x"}), R0, "api_token", "missing"),
    ("text last completion wrong type", _segments(GOOD_TEXT, {"completion": 12}), R1, "completion", "must be a string"),
    ("text later prompt wrong type", _segments(GOOD_TEXT, {"prompt": 12, "completion": "x"}), R1, "prompt", "must be a string"),
    ("repeated request id", '{"r": [{"prompt_tokens": 1, "completion_tokens": 1}], "r": []}', "file", "r", "appears twice"),
]


def _check(error: TraceError, path, record: str, field: str | None, problem: str) -> None:
    message = str(error)
    assert error.path == str(path)
    assert message.startswith(f"{path}: ")
    assert error.record.startswith(record), (error.record, record)
    assert record in message
    assert error.field == field
    if field is not None:
        assert f"field {field!r}" in message
    assert problem in error.problem, (error.problem, problem)


@pytest.mark.parametrize(("content", "record", "field", "problem"), [c[1:] for c in INFERCEPT_CASES], ids=[c[0] for c in INFERCEPT_CASES])
def test_infercept_json_errors(tmp_path, content, record, field, problem):
    path = tmp_path / "trace.json"
    path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    _check(caught.value, path, record, field, problem)
    assert path.read_bytes() == before


def test_message_names_file_record_and_field_exactly(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(_segments(GOOD_TOKENS, {"completion_tokens": -3}))
    with pytest.raises(TraceError) as caught:
        load_infercept_json(path)
    assert str(caught.value) == (
        f"{path}: request 'r' segment 1: field 'completion_tokens': must be a non-negative integer, got -3 (int)"
    )


def test_not_utf8(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"r": "\xff"}')
    with pytest.raises(TraceError, match="not UTF-8") as caught:
        load_infercept_json(path)
    assert caught.value.path == str(path)


def test_trace_error_is_a_value_error_and_pickles():
    error = TraceError("a.json", "request 'r'", "api_time", "missing")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.record, copy.field, copy.problem) == ("a.json", "request 'r'", "api_time", "missing")
    assert str(copy) == str(error) == "a.json: request 'r': field 'api_time': missing"


GOOD_LINE = {"id": "r1", "prompt_tokens": 5, "segments": [
    {"output_tokens": 2, "api": {"type": "math", "duration_s": 0.1, "return_tokens": 3}},
    {"output_tokens": 4},
]}
L1 = "line 1 (request 'r1')"


def _line(**changes) -> str:
    record = {**GOOD_LINE, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not _DROP})


def _first_segment(**changes) -> list:
    first = {**GOOD_LINE["segments"][0], **changes}
    return [{k: v for k, v in first.items() if v is not _DROP}, GOOD_LINE["segments"][1]]


def _api(**changes) -> list:
    api = {**GOOD_LINE["segments"][0]["api"], **changes}
    return _first_segment(api={k: v for k, v in api.items() if v is not _DROP})


JSONL_CASES = [
    ("empty", "", "file", None, "no requests"),
    ("only blank lines", "\n \n", "file", None, "no requests"),
    ("not json", _line() + "\n{oops\n", "line 2", None, "not valid JSON"),
    ("not an object", "[1]\n", "line 1", None, "JSON object"),
    ("missing id", _line(id=_DROP), "line 1", "id", "non-empty string"),
    ("numeric id", _line(id=7), "line 1", "id", "7 (int)"),
    ("empty id", _line(id=""), "line 1", "id", "non-empty string"),
    ("missing prompt", _line(prompt_tokens=_DROP), L1, "prompt_tokens", "missing"),
    ("negative prompt", _line(prompt_tokens=-1), L1, "prompt_tokens", "non-negative integer"),
    ("unknown key", _line(arival_s=1.0), L1, "arival_s", "unknown key"),
    ("negative arrival", _line(arrival_s=-0.5), L1, "arrival_s", "-0.5"),
    ("nan arrival", _line(arrival_s=float("nan")), L1, "arrival_s", "nan"),
    ("template not a string", _line(template_id=3), L1, "template_id", "must be a string"),
    ("missing segments", _line(segments=_DROP), L1, "segments", "missing"),
    ("empty segments", _line(segments=[]), L1, "segments", "non-empty list"),
    ("segment not an object", _line(segments=[3]), f"{L1} segment 0", None, "JSON object"),
    ("missing output", _line(segments=_first_segment(output_tokens=_DROP)), f"{L1} segment 0", "output_tokens", "missing"),
    ("bool output", _line(segments=_first_segment(output_tokens=True)), f"{L1} segment 0", "output_tokens", "(bool)"),
    ("no call before last", _line(segments=_first_segment(api=_DROP)), f"{L1} segment 0", "api", "missing"),
    ("incomplete trailing call", _line(segments=[{"output_tokens": 1, "api": {}}]), f"{L1} segment 0", "api.type", "missing"),
    ("trailing call not an object", _line(segments=[{"output_tokens": 1, "api": 3}]), f"{L1} segment 0", "api", "JSON object"),
    ("api not an object", _line(segments=_first_segment(api="math")), f"{L1} segment 0", "api", "JSON object"),
    ("unknown api type", _line(segments=_api(type="calculator")), f"{L1} segment 0", "api.type", "one of math"),
    ("unhashable api type", _line(segments=_api(type=["math"])), f"{L1} segment 0", "api.type", "(list)"),
    ("missing duration", _line(segments=_api(duration_s=_DROP)), f"{L1} segment 0", "api.duration_s", "missing"),
    ("negative duration", _line(segments=_api(duration_s=-2.0)), f"{L1} segment 0", "api.duration_s", "-2.0 (float)"),
    ("bool return", _line(segments=_api(return_tokens=False)), f"{L1} segment 0", "api.return_tokens", "(bool)"),
    ("unknown api key", _line(segments=_api(tokens=3)), f"{L1} segment 0", "api.tokens", "unknown key"),
    ("repeated id", _line() + "\n" + _line(id="r2") + "\n" + _line() + "\n", "line 3 (request 'r1')", "id", "line 1"),
    ("blank lines still count", _line() + "\n\n" + _line(id="r2", prompt_tokens="5") + "\n", "line 3 (request 'r2')", "prompt_tokens", "'5' (str)"),
]


@pytest.mark.parametrize(("content", "record", "field", "problem"), [c[1:] for c in JSONL_CASES], ids=[c[0] for c in JSONL_CASES])
def test_jsonl_errors(tmp_path, content, record, field, problem):
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(TraceError) as caught:
        load_jsonl(path)
    _check(caught.value, path, record, field, problem)
    assert path.read_bytes() == before
