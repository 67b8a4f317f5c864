"""The Claude Code sessions loader: tasks, tool gaps, compaction, subagents, trailing calls, token scaling, bad records."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.workload import (
    ApiCall,
    ApiType,
    Spawn,
    TraceError,
    build_request,
    load_claude_code,
    load_jsonl,
    load_trace,
    named_trace,
    poisson_arrivals,
    save_jsonl,
    scale_tokens,
)

BS = 64
REPO_DATA = Path(__file__).resolve().parents[1] / "data" / "workloads"
BUNDLED = "claude_code_sessions.jsonl.gz"


def call(tokens_in, out, stop="tool_use", think=None, t=0.0, prefix=None, kind="n"):
    """One model call; `prefix` None: the previous call's blocks (filled in by `conversation`)."""
    record = {"t": t, "type": kind, "in": tokens_in, "out": out, "stop": stop, "blocks": tokens_in // BS}
    if think is not None:
        record["think_time"] = think
    if prefix is not None:
        record["prefix_blocks"] = prefix
    return record


def subagent(end_t, duration_s, calls):
    return {"t": end_t, "type": "subagent", "duration_ms": duration_s * 1000, "requests": _filled(calls)}


def _filled(items):
    previous = 0
    for item in items:
        if item["type"] != "subagent":
            item.setdefault("prefix_blocks", previous)
            previous = item["blocks"]
    return items


def conversation(name, items, block_size=BS):
    return {"id": name, "block_size": block_size, "models": ["m"], "requests": _filled(items)}


def write(tmp_path, *conversations, name="s.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


def load(tmp_path, *conversations):
    return load_claude_code(write(tmp_path, *conversations))


# --- tasks and tool gaps ------------------------------------------------------------------


def test_a_task_is_the_calls_up_to_the_answer_and_a_tool_gap_is_its_call(tmp_path):
    (task,) = load(tmp_path, conversation("c", [
        call(1000, 50), call(1200, 30, think=4.0), call(1500, 80, "end_turn", think=9.0)]))
    assert task.request_id == "c:t0"
    assert [s.context_tokens for s in task.segments] == [1000, 1200, 1500]
    assert [s.output_tokens for s in task.segments] == [50, 30, 80]
    assert [s.api.duration_s for s in task.segments[:2]] == [4.0, 9.0]
    assert all(s.api.api_type is ApiType.TOOL for s in task.segments[:2])
    assert [s.api.return_tokens for s in task.segments[:2]] == [150, 270]  # the growth past in + out
    assert not any(s.api.compacts for s in task.segments[:2])
    assert task.segments[-1].api is None and task.arrival_s == 0.0 and task.spawned_by is None


def test_an_answer_ends_the_task_and_the_human_gap_is_in_no_request(tmp_path):
    first, second, third = load(tmp_path, conversation("c", [
        call(1000, 50, "end_turn"),
        call(2000, 40, think=300.0, t=400.0), call(2100, 20, "", think=2.0, t=410.0),  # "" ends a task too
        call(2500, 10, "end_turn", think=900.0, t=1400.0)]))
    assert [r.request_id for r in (first, second, third)] == ["c:t0", "c:t1", "c:t2"]
    assert [r.prompt_tokens for r in (first, second, third)] == [1000, 2000, 2500]
    assert [r.num_calls for r in (first, second, third)] == [0, 1, 0]
    assert second.api_time_s == 2.0  # the human's 300 s and 900 s belong to no request


# --- compaction ---------------------------------------------------------------------------


def test_compaction_keeps_the_identical_prefix_and_recomputes_the_rest(tmp_path):
    # 40,000 tokens in, then the client compacts: only the first 10 blocks repeat.
    (task,) = load(tmp_path, conversation("c", [
        call(40_000, 100), call(5_000, 60, think=3.0, prefix=10), call(5_200, 30, "end_turn", think=1.0)]))
    compaction = task.segments[0].api
    assert compaction.compacts and compaction.kept_tokens == 10 * BS
    assert compaction.return_tokens == 5_000 - 640  # the new input, all to compute
    assert task.segments[1].context_tokens == 5_000  # the context shrank, not clamped
    assert task.final_context_tokens == 40_100  # the longest came before the compaction
    assert not task.segments[1].api.compacts


def test_an_intact_input_with_a_shorter_follow_up_keeps_only_the_input_blocks(tmp_path):
    # The previous input survived whole, but the next input is shorter than in + out (its output
    # was not sent back as generated, e.g. thinking dropped): only the known-identical blocks are kept.
    (task,) = load(tmp_path, conversation("c", [call(6_400, 500), call(6_600, 10, "end_turn", think=2.0)]))
    api = task.segments[0].api
    assert api.kept_tokens == 100 * BS and api.return_tokens == 6_600 - 6_400
    assert task.segments[1].context_tokens == 6_600


def test_a_broken_last_block_is_a_compaction_of_that_block(tmp_path):
    (task,) = load(tmp_path, conversation("c", [call(6_450, 20), call(7_000, 10, "end_turn", think=1.0, prefix=99)]))
    api = task.segments[0].api
    assert api.kept_tokens == 99 * BS and api.return_tokens == 7_000 - 99 * BS


# --- trailing calls -----------------------------------------------------------------------


def test_a_conversation_that_ends_on_tool_use_ends_with_a_trailing_call(tmp_path):
    first, last = load(tmp_path, conversation("c", [call(1000, 5, "end_turn"), call(1500, 40, think=60.0),
                                                    call(1700, 25, think=2.0)]))
    assert not first.ends_with_call
    assert last.ends_with_call and last.num_calls == 2
    trailing = last.segments[-1].api
    assert (trailing.api_type, trailing.duration_s, trailing.return_tokens) == (ApiType.TOOL, 0.0, 0)
    assert last.final_context_tokens == 1725


# --- subagents ----------------------------------------------------------------------------


def _with_subagents():
    return conversation("c", [
        call(10_000, 100, t=0.0),
        call(12_000, 200, t=20.0, think=10.0),  # its tool_use starts two subagents at 40 s
        subagent(70.0, 30.0, [call(3_000, 50, t=0.0), call(3_500, 40, "end_turn", t=9.0, think=4.0)]),
        subagent(90.0, 50.0, [call(2_000, 20, "end_turn", t=0.0)]),
        call(15_000, 60, "end_turn", t=95.0, think=55.0),
        subagent(500.0, 10.0, [call(1_000, 10, "end_turn")]),  # after an answer: no call started it
    ])


def test_subagents_load_as_requests_tied_to_the_parent_call_that_started_them(tmp_path):
    parent, first, second, alone = load(tmp_path, _with_subagents())
    assert [r.request_id for r in (parent, first, second, alone)] == ["c:t0", "c:sa1:t0", "c:sa2:t0", "c:sa3:t0"]
    assert first.spawned_by == Spawn("c:t0", 1) and second.spawned_by == Spawn("c:t0", 1)
    assert first.arrival_s == 40.0 and second.arrival_s == 40.0  # their start, after the parent task's start
    assert [s.context_tokens for s in first.segments] == [3_000, 3_500]
    assert parent.segments[1].api.duration_s == 55.0  # the parent waits its recorded time
    assert alone.spawned_by is None and alone.arrival_s == 0.0


def test_a_subagent_comes_with_each_arrival_of_its_parent_and_never_alone(tmp_path):
    templates = load(tmp_path, _with_subagents())
    stream = poisson_arrivals(templates, qps=0.5, duration_s=200.0, seed=4)
    by_id = {r.request_id: r for r in stream}
    parents = [r for r in stream if r.template_id == "c:t0"]
    assert parents
    for parent in parents:
        n = parent.request_id.split("#")[1]
        for child_id in ("c:sa1:t0", "c:sa2:t0"):
            child = by_id[f"{child_id}#{n}"]
            assert child.spawned_by == Spawn(parent.request_id, 1)
            assert child.arrival_s == pytest.approx(parent.arrival_s + 40.0)
    assert sum(r.template_id == "c:sa1:t0" for r in stream) == len(parents)  # drawn only with a parent
    assert [r.arrival_s for r in stream] == sorted(r.arrival_s for r in stream)
    roots = [t for t in templates if t.spawned_by is None]
    alone = poisson_arrivals(roots, qps=0.5, duration_s=200.0, seed=4)
    assert [r.request_id for r in alone] == [r.request_id for r in stream if r.spawned_by is None]


def test_a_template_whose_parent_is_missing_is_an_error():
    orphan = build_request("x", 10, [(5, None)])
    with pytest.raises(ValueError, match="not among the templates"):
        poisson_arrivals([build_request("p", 10, [(5, None)]), replace(orphan, spawned_by=Spawn("gone", 0))],
                         qps=1.0, duration_s=5.0, seed=0)


# --- token scaling ------------------------------------------------------------------------


def test_token_scaling_scales_contexts_where_they_stand(tmp_path):
    items = [call(20_000 + 997 * k, 33, t=float(k), think=1.0) for k in range(60)]
    items.append(call(90_000, 10, "end_turn", think=1.0))
    (task,) = load(tmp_path, conversation("c", items))
    scaled = scale_tokens(task, 0.25)
    assert [s.context_tokens for s in scaled.segments] == [round(s.context_tokens * 0.25) for s in task.segments]
    assert [s.output_tokens for s in scaled.segments] == [8] * 60 + [2]  # 33 × 0.25 = 8.25, 10 × 0.25 = 2.5
    assert [s.api.duration_s for s in scaled.segments[:-1]] == [1.0] * 60
    assert scale_tokens(task, 1) is task


def test_token_scaling_keeps_compaction_trailing_calls_and_ties(tmp_path):
    parent, child, *_ = load(tmp_path, _with_subagents())
    (compacted,) = load(tmp_path, conversation("d", [call(40_000, 100), call(5_000, 60, think=3.0, prefix=10),
                                                     call(5_200, 3, think=1.0)]))
    scaled = scale_tokens(compacted, 0.1)
    assert scaled.segments[0].api.kept_tokens == 64 and scaled.segments[1].context_tokens == 500
    assert scaled.segments[2].output_tokens == 1  # 0.3 tokens: kept at 1, a generating segment keeps generating
    assert scaled.ends_with_call and [s.api.duration_s for s in scaled.segments] == [3.0, 1.0, 0.0]
    returning = build_request("r", 100, [(10, ApiCall(ApiType.TOOL, 2.0, 40))])  # a trailing call with a return
    assert scale_tokens(returning, 0.1).segments[0].api.return_tokens == 4
    tied = scale_tokens(child, 0.1)
    assert tied.spawned_by == child.spawned_by and tied.arrival_s == child.arrival_s


@pytest.mark.parametrize("factor", [0, -1, float("nan"), float("inf"), True])
def test_a_bad_token_scale_is_an_error(factor, tmp_path):
    (task, *_) = load(tmp_path, _with_subagents())
    with pytest.raises(ValueError, match="token scale"):
        scale_tokens(task, factor)


def test_a_simulated_run_scales_tokens_and_says_so(tmp_path):
    path = write(tmp_path, _with_subagents())
    spec = RunSpec("mars", qps=0.2, trace=str(path), duration_s=30.0, token_scale=0.5)
    record = run_one(spec)
    assert record["token_scale"] == 0.5 and record["trace"] == str(path)
    assert record["num_finished"] == record["num_requests"] > 0
    assert run_one(RunSpec("mars", qps=0.2, trace=str(path), duration_s=30.0))["token_scale"] == 1.0


# --- the workload model and the JSONL format carry what the loader builds -------------------


def test_build_request_rejects_keeping_more_than_the_context_and_normalises_keeping_all():
    with pytest.raises(ValueError, match="keeps 31 tokens of a 30-token context"):
        build_request("r", 20, [(10, ApiCall(ApiType.TOOL, 1.0, 5, kept_tokens=31)), (1, None)])
    whole = build_request("r", 20, [(10, ApiCall(ApiType.TOOL, 1.0, 5, kept_tokens=30)), (1, None)])
    assert whole.segments[0].api.kept_tokens is None and whole.segments[1].context_tokens == 35


def test_marsched_jsonl_round_trips_compaction_and_ties(tmp_path):
    requests = load(tmp_path, _with_subagents()) + load(tmp_path, conversation("d", [
        call(40_000, 100), call(5_000, 60, "end_turn", think=3.0, prefix=10)]))
    assert load_jsonl(save_jsonl(requests, tmp_path / "out.jsonl")) == requests
    line = json.dumps({"id": "r", "prompt_tokens": 10, "segments": [
        {"output_tokens": 5, "api": {"type": "tool", "duration_s": 1, "return_tokens": 2, "kept_tokens": 16}},
        {"output_tokens": 1}]})
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with pytest.raises(TraceError) as caught:
        load_jsonl(tmp_path / "bad.jsonl")
    assert (caught.value.record, caught.value.field) == ("line 1 (request 'r') segment 0", "api.kept_tokens")


def test_load_trace_recognises_session_files_plain_and_gzip(tmp_path):
    plain = write(tmp_path, _with_subagents(), name="mine.jsonl")
    packed = tmp_path / "mine.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(plain) == load_trace(packed) == load_claude_code(packed) == load_claude_code(plain)


# --- malformed records --------------------------------------------------------------------


def _conv(**changes):
    record = conversation("c", [call(1000, 50), call(1200, 30, "end_turn", think=4.0)])
    for key, value in changes.items():
        if value is _DROP:
            del record[key]
        else:
            record[key] = value
    return json.dumps(record)


def _call1(**changes):
    """The conversation with its request 1 changed (a value of _DROP removes the key)."""
    record = conversation("c", [call(1000, 50), call(1200, 30, "end_turn", think=4.0)])
    for key, value in changes.items():
        if value is _DROP:
            del record["requests"][1][key]
        else:
            record["requests"][1][key] = value
    return json.dumps(record)


def _sub(**changes):
    sa = subagent(9.0, 2.0, [call(500, 5), call(600, 5, "end_turn", think=1.0)])
    for key, value in changes.items():
        if value is _DROP:
            del sa[key]
        else:
            sa[key] = value
    return json.dumps(conversation("c", [call(1000, 50), sa, call(1200, 30, "end_turn", think=4.0)]))


_DROP = object()
C = "line 1 (conversation 'c')"
R1 = f"{C} request 1"
SA = f"{C} request 1 (subagent)"

BAD = [
    ("empty file", "", "file", None, "no conversations"),
    ("not json", "{", "line 1", None, "not valid JSON"),
    ("not an object", "[1]", "line 1", None, "JSON object"),
    ("no id", _conv(id=_DROP), "line 1", "id", "non-empty string"),
    ("empty id", _conv(id=""), "line 1", "id", "non-empty string"),
    ("repeated key", '{"id": "c", "id": "d"}', "line 1", "id", "appears twice"),
    ("no block size", _conv(block_size=_DROP), C, "block_size", "missing"),
    ("zero block size", _conv(block_size=0), C, "block_size", "at least 1"),
    ("no requests", _conv(requests=_DROP), C, "requests", "missing"),
    ("empty requests", _conv(requests=[]), C, "requests", "non-empty list"),
    ("request not an object", _conv(requests=[5]), f"{C} request 0", None, "JSON object"),
    ("no type", _call1(type=_DROP), R1, "type", "missing"),
    ("bad type", _call1(type="x"), R1, "type", "one of n, s, subagent"),
    ("no t", _call1(t=_DROP), R1, "t", "missing"),
    ("negative t", _call1(t=-1), R1, "t", "seconds >= 0"),
    ("no in", _call1(**{"in": _DROP}), R1, "in", "missing"),
    ("string in", _call1(**{"in": "1200"}), R1, "in", "'1200' (str)"),
    ("negative out", _call1(out=-3), R1, "out", "non-negative integer"),
    ("fractional out", _call1(out=2.5), R1, "out", "2.5"),
    ("no stop", _call1(stop=_DROP), R1, "stop", "missing"),
    ("bad stop", _call1(stop="max_tokens"), R1, "stop", "'max_tokens'"),
    ("no think time after tool_use", _call1(think_time=_DROP), R1, "think_time", "missing"),
    ("negative think time", _call1(think_time=-2.0), R1, "think_time", "-2.0"),
    ("null think time", _call1(think_time=None), R1, "think_time", "None"),
    ("no blocks", _call1(blocks=_DROP), R1, "blocks", "missing"),
    ("blocks disagree with in", _call1(blocks=3), R1, "blocks", "in // block_size = 18"),
    ("no prefix blocks", _call1(prefix_blocks=_DROP), R1, "prefix_blocks", "missing"),
    ("prefix past the previous input", _call1(prefix_blocks=16), R1, "prefix_blocks", "previous request's 15"),
    ("subagent without duration", _sub(duration_ms=_DROP), SA, "duration_ms", "missing"),
    ("subagent with a bad end", _sub(t="9"), SA, "t", "(str)"),
    ("subagent without requests", _sub(requests=[]), SA, "requests", "non-empty list"),
    ("subagent call with a bad field", _sub(requests=_filled([call(500, 5), call(600, -5, "end_turn", think=1.0)])),
     f"{SA} request 1", "out", "non-negative integer"),
    ("only subagents", _conv(requests=[subagent(1.0, 1.0, [call(500, 5, "end_turn")])]), C, "requests",
     "no model call"),
]


@pytest.mark.parametrize("content, record, field, words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_malformed_record_names_the_file_conversation_request_and_field(tmp_path, content, record, field, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        load_claude_code(path)
    error = caught.value
    assert (error.path, error.record, error.field) == (str(path), record, field)
    assert words in error.problem
    assert str(error).startswith(f"{path}: {record}")


def test_a_repeated_conversation_id_names_the_first_line(tmp_path):
    path = tmp_path / "twice.jsonl"
    path.write_text(_conv() + "\n\n" + _conv() + "\n")
    with pytest.raises(TraceError) as caught:
        load_claude_code(path)
    assert (caught.value.record, caught.value.field) == ("line 3 (conversation 'c')", "id")
    assert "line 1" in caught.value.problem


def test_a_broken_gzip_file_is_an_error(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": "c"}\n')[:-6])
    with pytest.raises(TraceError, match="not a readable gzip file"):
        load_claude_code(path)


# --- the bundled file ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    return load_trace("claude-code")


def test_the_bundled_file_holds_what_the_docs_say(bundled):
    assert len({r.request_id.split(":")[0] for r in bundled}) == 360
    assert len(bundled) == 3377
    assert sum(len(r.segments) for r in bundled) == 24108  # every model call, subagents' included
    subagent_tasks = [r for r in bundled if ":sa" in r.request_id]
    assert len(subagent_tasks) == 38 and sum(r.spawned_by is not None for r in bundled) == 36
    assert len({r.request_id.split(":")[0] for r in subagent_tasks}) == 10
    assert sum(r.ends_with_call for r in bundled) == 159
    assert sum(len(r.segments) == 1 for r in bundled) == 1522
    between = [s.api for r in bundled for s in r.segments[:-1]]
    assert len(between) == 20731 and sum(c.compacts for c in between) == 3132
    assert max(r.final_context_tokens for r in bundled) == 895_166
    assert named_trace("claude_code_sessions") is named_trace(BUNDLED) is named_trace("claude-code")


def test_the_bundled_copies_are_identical_and_the_content_is_the_recorded_one():
    packaged = files("marsched.workload") / "data"
    for name in (BUNDLED, "LICENSE-kv-cache-tester.txt"):
        assert (packaged / name).read_bytes() == (REPO_DATA / name).read_bytes(), name
    content = gzip.decompress((REPO_DATA / BUNDLED).read_bytes())
    recorded = "52724893c05f746368b98c417ca4ea12f9cceb7d7caf2b1f485c5ad33803e1d9"
    assert hashlib.sha256(content).hexdigest() == recorded
    assert recorded in (REPO_DATA / "README.md").read_text()


# --- the command --------------------------------------------------------------------------


def _marsched(*args):
    command = [sys.executable, "-m", "marsched.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_simulate_takes_a_token_scale_and_states_it(tmp_path):
    trace, out = write(tmp_path, _with_subagents()), tmp_path / "run.json"
    run = _marsched("simulate", "--trace", str(trace), "--qps", "0.2", "--duration", "30", "--token-scale", "0.5",
                    "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())[0]["token_scale"] == 0.5
    assert "tokens × 0.5" in run.stdout


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_token_scale_on_the_command_line_names_the_option(value):
    run = _marsched("simulate", "--trace", "claude-code", "--token-scale", value)
    assert run.returncode != 0 and "--token-scale" in run.stderr


@pytest.mark.parametrize("spawn, field, words", [
    (7, "spawned_by", "JSON object"),
    ({"parent": "", "segment": 0}, "spawned_by.parent", "non-empty string"),
    ({"parent": "p", "segment": -1}, "spawned_by.segment", "non-negative integer"),
    ({"parent": "p"}, "spawned_by.segment", "missing"),
    ({"parent": "p", "segment": 0, "offset": 1}, "spawned_by.offset", "unknown key"),
])
def test_a_bad_tie_in_marsched_jsonl_names_its_field(tmp_path, spawn, field, words):
    line = json.dumps({"id": "r", "prompt_tokens": 10, "segments": [{"output_tokens": 1}], "spawned_by": spawn})
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with pytest.raises(TraceError) as caught:
        load_jsonl(tmp_path / "bad.jsonl")
    assert (caught.value.record, caught.value.field) == ("line 1 (request 'r')", field)
    assert words in caught.value.problem
