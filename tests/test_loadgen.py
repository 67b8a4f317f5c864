"""`marsched loadgen` without vLLM: trace loading, arrivals, the closed loop, the report, the command
against a small fake OpenAI server, bad input; and, where vLLM is installed (no engine), that the
reply length reaches the logits processor and no input of the scheduler."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from marsched.loadgen.agent_text import AgentTextError, load_agent_text, parse_agent_text
from marsched.loadgen.arrivals import Arrival, session_arrivals
from marsched.loadgen.claude_code import load_claude_code, session_from_request
from marsched.loadgen.client import KEEPALIVE_S, base_url, open_client, turn_xargs
from marsched.loadgen.filler import WORDS, GrowingContext, filler
from marsched.loadgen.options import LoadgenOptions
from marsched.loadgen.records import ConversationRecord, TurnRecord
from marsched.loadgen.replay import GapShape, replay
from marsched.loadgen.report import build_report, stats, write_report
from marsched.loadgen.reply_target import REPLY_TOKENS_KEY, check_reply_target
from marsched.loadgen.session import GrownPrompt, Session, TextPrompt, Turn, shape_gap
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.model import ApiCall, ApiType, build_request
from marsched.workload.token_scale import scale_tokens
from marsched.workload.tokenizer import count_tokens

DATA = Path(__file__).resolve().parents[1] / "src" / "marsched" / "loadgen" / "data"


# --- trace loading ---------------------------------------------------------------------------------


def test_bundled_agent_text_has_every_session_and_call():
    miniswe, magagent = load_agent_text(("miniswe",)), load_agent_text(("magagent",))
    assert (len(miniswe), sum(len(s.turns) for s in miniswe)) == (20, 402)
    assert (len(magagent), sum(len(s.turns) for s in magagent)) == (25, 746)
    for session in miniswe + magagent:
        assert all(isinstance(t.prompt, TextPrompt) and t.reply_tokens >= 1 and t.gap_s >= 0 for t in session.turns)
        assert session.turns[-1].gap_s == 0
    assert len({s.key for s in miniswe + magagent}) == 45
    assert (DATA / "LICENSE-lmcache-agent-trace.txt").is_file() and "16a14ad" in (DATA / "README.md").read_text()


def test_agent_text_sorts_by_timestamp_and_measures_replies_and_gaps():
    rows = [{"timestamp": 3_500_000, "input": "a b c", "output": "third reply", "session_id": "s1"},
            {"timestamp": 1_000_000, "input": "a", "output": "first", "session_id": "s1"},
            {"timestamp": 2_000_000, "input": "a b", "output": "", "session_id": "s1"},
            {"timestamp": 5, "input": "other", "output": "x y", "session_id": "s2"}]
    sessions = parse_agent_text("\n".join(json.dumps(r) for r in rows) + "\n", "set", "f.jsonl")
    by_key = {s.key: s for s in sessions}
    s1 = by_key["set:s1"]
    assert [t.prompt.text for t in s1.turns] == ["a", "a b", "a b c"]
    assert [t.gap_s for t in s1.turns] == [1.0, 1.5, 0.0]
    assert [t.reply_tokens for t in s1.turns] == [count_tokens("first"), 1, count_tokens("third reply")]
    assert len(by_key["set:s2"].turns) == 1


def _bounded_rows() -> list[dict]:
    """A session whose inputs grow like an agent's: each extends the previous input and reply, except
    the third, which extends only the input (the reply is fed back reworded, another agent's way)."""
    first = "SYSTEM " * 10
    replies = ["reply one " * 5, "reply two " * 5, "reply three " * 5, ""]
    inputs = [first, first + replies[0] + "tool says " * 6, None, None]
    inputs[2] = inputs[1] + replies[1] + "result two"
    inputs[3] = inputs[2] + "\n\nassistant: " + replies[2][:7] + " tool three " * 4
    return [{"timestamp": i, "input": text, "output": reply, "session_id": "s"}
            for i, (text, reply) in enumerate(zip(inputs, replies))]


def _parse(rows: list[dict], turn_chars: int, reply_chars: int | None = None) -> Session:
    return parse_agent_text("\n".join(json.dumps(r) for r in rows) + "\n", "set", "f.jsonl", turn_chars,
                            reply_chars)[0]


def test_turn_chars_cuts_every_piece_and_rebuilds_the_prompts_from_the_cut_pieces():
    rows = _bounded_rows()
    session = _parse(rows, 12)
    prompts = [t.prompt.text for t in session.turns]
    cut_replies = [r["output"][:12] for r in rows]
    assert prompts[0] == rows[0]["input"][:12]
    assert prompts[1] == prompts[0] + cut_replies[0] + "tool says to"  # the new text: after input + reply
    assert prompts[2] == prompts[1] + cut_replies[1] + "result two"  # shorter than the cut: whole
    # input 4 extends input 3 only: its new text starts where it leaves input 3 + reply 3
    assert prompts[3] == prompts[2] + cut_replies[2] + "\n\nassistant:"
    assert [t.reply_tokens for t in session.turns] == [max(count_tokens(r), 1) for r in cut_replies]
    assert [t.gap_s for t in session.turns] == [1e-6, 1e-6, 1e-6, 0.0]


@pytest.mark.parametrize("turn_chars", [1, 12, 40, 10_000])
def test_bounded_prompts_extend_the_previous_prompt_and_reply_like_the_conversation(turn_chars):
    rows = _bounded_rows()
    rows.append({"timestamp": 9, "input": "another agent starts afresh", "output": "ok", "session_id": "s"})
    session = _parse(rows, turn_chars)
    for turn, after, row in zip(session.turns, session.turns[1:], rows):
        assert after.prompt.text.startswith(turn.prompt.text + row["output"][:turn_chars])
    # an input that does not extend the previous one still yields a prompt that extends it, cut
    assert session.turns[-1].prompt.text.endswith("another agent starts afresh"[:turn_chars])


@pytest.mark.parametrize("reply_chars", [0, 3, 30])
def test_reply_chars_cuts_the_replies_apart_from_the_new_texts(reply_chars):
    rows = _bounded_rows()
    session = _parse(rows, 12, reply_chars)
    replies = [r["output"][:reply_chars] if reply_chars else r["output"] for r in rows]
    assert [t.reply_tokens for t in session.turns] == [max(count_tokens(r), 1) for r in replies]
    prompts = [t.prompt.text for t in session.turns]
    assert prompts[0] == rows[0]["input"][:12]
    assert prompts[1] == prompts[0] + replies[0] + "tool says to"  # the new text still cut to 12
    for turn, after, reply in zip(session.turns, session.turns[1:], replies):
        assert after.prompt.text.startswith(turn.prompt.text + reply)
    with pytest.raises(ValueError, match="--reply-chars -1"):
        _parse(rows, 12, -1)
    with pytest.raises(ValueError, match="--reply-chars 5: only with --turn-chars"):
        _parse(rows, 0, 5)


def test_turn_chars_zero_leaves_the_turns_as_the_trace_has_them():
    rows = _bounded_rows()
    session = _parse(rows, 0)
    assert session == parse_agent_text("\n".join(json.dumps(r) for r in rows), "set", "f.jsonl")[0]
    assert [t.prompt.text for t in session.turns] == [r["input"] for r in rows]
    assert [t.reply_tokens for t in session.turns] == [max(count_tokens(r["output"]), 1) for r in rows]
    with pytest.raises(ValueError, match="--turn-chars -1"):
        _parse(rows, -1)


def test_bundled_agent_text_bounded_keeps_the_prefix_property_and_fits_a_small_model():
    sessions = load_agent_text(("miniswe",), turn_chars=200)
    assert len(sessions) == 20 and sum(len(s.turns) for s in sessions) == 402
    for session in sessions:
        for turn, after in zip(session.turns, session.turns[1:]):
            assert after.prompt.text.startswith(turn.prompt.text) and len(after.prompt.text) - len(turn.prompt.text) <= 400
        assert len(session.turns[0].prompt.text) <= 200


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not JSON"),
    ('{"timestamp": 1, "input": "a", "output": "b"}', "line 2: session_id: missing"),
    ('{"timestamp": -1, "input": "a", "output": "b", "session_id": "s"}', "line 2: timestamp"),
    ('{"timestamp": 1, "input": 3, "output": "b", "session_id": "s"}', "line 2: input: must be text"),
    ('{"timestamp": 1, "input": "a", "output": "b", "session_id": "a/b"}', "line 2: session_id"),
    ('[1, 2]', "line 2: not a JSON object"),
])
def test_agent_text_errors_name_file_line_and_field(line, message):
    good = json.dumps({"timestamp": 1, "input": "a", "output": "b", "session_id": "s"})
    with pytest.raises(AgentTextError, match=f"^f.jsonl: {message}"):
        parse_agent_text(good + "\n" + line + "\n", "set", "f.jsonl")


def test_claude_code_session_follows_the_request_and_its_scaling():
    request = build_request("conv:t0", 1000, [(50, ApiCall(ApiType.TOOL, 3.0, 200)),
                                              (40, ApiCall(ApiType.TOOL, 7.0, 100, kept_tokens=600)), (30, None)])
    session = session_from_request(request)
    assert [t.prompt for t in session.turns] == [GrownPrompt(0, 1000), GrownPrompt(None, 200), GrownPrompt(600, 100)]
    assert [(t.reply_tokens, t.gap_s) for t in session.turns] == [(50, 3.0), (40, 7.0), (30, 0.0)]
    scaled = session_from_request(scale_tokens(request, 0.1))  # the simulator's scaling, reused
    assert [t.reply_tokens for t in scaled.turns] == [s.output_tokens for s in scale_tokens(request, 0.1).segments]
    bundled = load_claude_code(0.01)
    assert len(bundled) == 3377 and sum(s.parent is not None for s in bundled) == 36


def test_filler_words_are_one_token_each_in_the_tokenizer_marsched_model_builds(tmp_path):
    from tokenizers import Tokenizer

    from marsched.bench.model import ModelShape, _build_tokenizer

    _build_tokenizer(tmp_path, ModelShape())
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert {word: len(tokenizer.encode(" " + word, add_special_tokens=False).ids) for word in WORDS} == {
        word: 1 for word in WORDS}


def test_filler_words_are_one_gpt2_token_each_and_the_context_grows_like_an_agents():
    assert all(count_tokens(" " + word) == 1 for word in WORDS)
    assert count_tokens(filler(500, __import__("random").Random(1))) == 500
    context = GrowingContext.for_conversation("c#0")
    first = context.grow(GrownPrompt(0, 10))
    context.add_reply(" REPLY", 3)
    second = context.grow(GrownPrompt(None, 5))
    assert second.startswith(first + " REPLY") and context.tokens == 18
    context.add_reply(" MORE", 2)
    third = context.grow(GrownPrompt(12, 4))  # compacted: the first 12 tokens are kept, then 4 new
    assert third.startswith(first) and " REPLY" not in third and context.tokens == 16
    assert GrowingContext.for_conversation("c#0").grow(GrownPrompt(0, 10)) == first  # seeded by the id
    assert GrowingContext.for_conversation("c#1").grow(GrownPrompt(0, 10)) != first


def test_max_turns_cuts_and_the_gap_is_scaled_then_capped():
    session = Session("k", tuple(Turn(TextPrompt(str(i)), 5, 10.0) for i in range(4)))
    cut = session.first_turns(2)
    assert len(cut.turns) == 2 and cut.turns[-1].gap_s == 0 and session.first_turns(0) is session
    assert shape_gap(10.0, 0.5, None) == 5.0 and shape_gap(10.0, 2.0, 8.0) == 8.0 and shape_gap(-1, 1, None) == 0


# --- arrivals -----------------------------------------------------------------------------------


def _sessions(n: int) -> list[Session]:
    return [Session(f"s{i}", (Turn(TextPrompt("p"), 3, 1.0), Turn(TextPrompt("q"), 2, 0.0))) for i in range(n)]


def test_poisson_arrivals_are_the_simulators_and_a_seed_fixes_them():
    sessions = _sessions(5)
    first = session_arrivals(sessions, 2.0, 300.0, seed=7)
    again = session_arrivals(sessions, 2.0, 300.0, seed=7)
    other = session_arrivals(sessions, 2.0, 300.0, seed=8)
    assert first == again and [a.arrival_s for a in first] != [a.arrival_s for a in other]
    assert 500 < len(first) < 700  # about rate × duration
    times = [a.arrival_s for a in first]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 300
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.06  # exponential gaps, mean 1/rate
    reference = poisson_arrivals([build_request(s.key, 1, [(1, None)]) for s in sessions], 2.0, 300.0, 7)
    assert [(a.conversation, a.arrival_s) for a in first] == [(r.request_id, r.arrival_s) for r in reference]
    assert len({a.conversation for a in first}) == len(first)


def test_a_subagent_comes_with_its_parent_unless_the_parent_stops_before_calling_it():
    parent = Session("p", tuple(Turn(TextPrompt(str(i)), 2, 1.0) for i in range(3)))
    child = Session("p:sa1", (Turn(TextPrompt("c"), 2, 0.0),), parent="p", parent_turn=2)
    arrivals = session_arrivals([parent, child], 1.0, 20.0, 0)
    roots = [a for a in arrivals if a.parent is None]
    assert len(arrivals) == 2 * len(roots) and roots
    for index, arrival in enumerate(arrivals):
        if arrival.parent is not None:
            assert arrivals[index - 1].conversation == arrival.parent and arrival.parent_turn == 2
    cut = session_arrivals([parent.first_turns(2), child], 1.0, 20.0, 0)
    assert all(a.parent is None for a in cut) and len(cut) == len(roots)


# --- the closed loop --------------------------------------------------------------------------------


class FakeSend:
    """Replies after `latency_s` with the target's length; fails the turns in `fail`."""

    def __init__(self, latency_s: float = 0.01, fail: set[tuple[str, int]] = frozenset()) -> None:
        self.latency_s, self.fail, self.prompts = latency_s, fail, []

    async def __call__(self, prompt: str, turn: TurnRecord, conversation: str, last: bool) -> str:
        turn.sent_s = time.monotonic() - self.clock0
        self.prompts.append((conversation, turn.index, prompt))
        self.lasts = getattr(self, "lasts", []) + [(conversation, turn.index, last)]
        await asyncio.sleep(self.latency_s)
        if (conversation, turn.index) in self.fail:
            turn.error = "HTTP 500: boom"
            return ""
        turn.ttft_s, turn.latency_s = self.latency_s / 2, self.latency_s
        turn.prompt_tokens, turn.completion_tokens, turn.finish_reason = 10, turn.target_tokens, "stop"
        return " reply"


def _replay(arrivals, send, gaps=GapShape(), **kwargs):
    async def main():
        send.clock0 = time.monotonic()
        return await replay(arrivals, send, gaps, clock0=send.clock0, **kwargs)

    return asyncio.run(main())


def test_the_next_turn_waits_for_the_reply_and_the_gap():
    session = Session("s", (Turn(TextPrompt("a"), 3, 0.2), Turn(TextPrompt("b"), 2, 0.3), Turn(TextPrompt("c"), 1, 9)))
    send = FakeSend(latency_s=0.05)
    result = _replay([Arrival(session, "s#0", 0.1)], send)
    turns = result.conversations[0].turns
    assert [t.index for t in turns] == [0, 1, 2] and not result.interrupted
    assert turns[0].sent_s >= 0.1 - 0.01
    assert turns[1].sent_s >= turns[0].end_s + 0.2 - 0.01
    assert turns[2].sent_s >= turns[1].end_s + 0.3 - 0.01
    assert result.conversations[0].finished and result.conversations[0].e2e_s >= 0.15 + 0.5


def test_gap_scale_and_cap_shorten_the_wait():
    session = Session("s", (Turn(TextPrompt("a"), 3, 5.0), Turn(TextPrompt("b"), 2, 0.0)))
    result = _replay([Arrival(session, "s#0", 0.0)], FakeSend(), GapShape(scale=0.5, cap_s=0.1))
    first, second = result.conversations[0].turns
    assert 0.1 - 0.01 <= second.sent_s - first.end_s < 1.0


def test_only_each_conversations_last_turn_is_sent_as_its_last():
    parent = Session("p", (Turn(TextPrompt("a"), 3, 0.0), Turn(TextPrompt("b"), 2, 0.0), Turn(TextPrompt("c"), 2, 0)))
    child = Session("p:sa1", (Turn(TextPrompt("x"), 2, 0.0),), parent="p", parent_turn=0)
    send = FakeSend()
    _replay([Arrival(parent, "p#0", 0.0), Arrival(child, "p:sa1#0", 0.0, "p#0", 0)], send)
    assert sorted(send.lasts) == [("p#0", 0, False), ("p#0", 1, False), ("p#0", 2, True), ("p:sa1#0", 0, True)]


def test_a_failed_turn_ends_its_conversation_and_its_subagents_never_start():
    parent = Session("p", (Turn(TextPrompt("a"), 3, 0.0), Turn(TextPrompt("b"), 2, 0.0), Turn(TextPrompt("c"), 2, 0)))
    child = Session("p:sa1", (Turn(TextPrompt("x"), 2, 0.0),), parent="p", parent_turn=1)
    arrivals = [Arrival(parent, "p#0", 0.0), Arrival(child, "p:sa1#0", 0.0, "p#0", 1)]
    done = []
    result = _replay(arrivals, FakeSend(fail={("p#0", 1)}), on_turn=done.append)
    record, child_record = result.conversations
    assert [t.error for t in record.turns] == [None, "HTTP 500: boom"] and record.failed and not record.finished
    assert not child_record.started and sum(done) == 3  # the failed turn and the one after it counted as done


def test_a_subagent_starts_when_its_parents_calling_turn_has_ended():
    parent = Session("p", (Turn(TextPrompt("a"), 3, 0.3), Turn(TextPrompt("b"), 2, 0.0)))
    child = Session("p:sa1", (Turn(TextPrompt("x"), 2, 0.0),), parent="p", parent_turn=0)
    result = _replay([Arrival(parent, "p#0", 0.0), Arrival(child, "p:sa1#0", 0.0, "p#0", 0)], FakeSend(latency_s=0.05))
    record, child_record = result.conversations
    assert child_record.finished and child_record.arrival_s >= record.turns[0].end_s - 1e-3
    assert child_record.turns[0].sent_s < record.turns[1].sent_s  # beside the parent, during its gap


def test_max_concurrency_holds_the_others_until_a_slot_frees_and_times_them_from_then():
    sessions = [Session(f"s{i}", (Turn(TextPrompt("a"), 2, 0.1), Turn(TextPrompt("b"), 2, 0.0))) for i in range(5)]
    arrivals = [Arrival(s, f"{s.key}#0", 0.01 * i) for i, s in enumerate(sessions)]
    send = FakeSend(latency_s=0.05)
    result = _replay(arrivals, send, max_concurrency=2)
    records = result.conversations
    assert all(r.finished for r in records)
    spans = [(r.turns[0].sent_s, r.turns[-1].end_s) for r in records]
    for t, _ in spans:  # never more than 2 conversations between their first send and their end
        assert sum(1 for start, end in spans if start <= t + 1e-6 < end) <= 2
    assert [r.turns[0].sent_s for r in records] == sorted(r.turns[0].sent_s for r in records)  # in arrival order
    waited = records[2]
    assert waited.arrival_s >= records[0].turns[-1].end_s - 0.01  # it arrived, for its record, at its slot
    assert waited.e2e_s < 0.35  # two turns and a gap: the wait for the slot is not in it
    unlimited = _replay(arrivals, FakeSend(latency_s=0.05))
    assert max(r.turns[0].sent_s for r in unlimited.conversations) < 0.1


def test_token_count_turns_send_the_context_with_the_served_replies():
    session = Session("s", (Turn(GrownPrompt(0, 4), 2, 0.0), Turn(GrownPrompt(None, 3), 2, 0.0)))
    send = FakeSend()
    _replay([Arrival(session, "s#0", 0.0)], send)
    (_, _, first), (_, _, second) = send.prompts
    assert second.startswith(first + " reply") and len(second.split()) == 4 + 1 + 3


def test_sigint_stops_the_run_and_keeps_what_finished():
    sessions = [Session(f"s{i}", tuple(Turn(TextPrompt("t"), 2, 0.2) for _ in range(50))) for i in range(3)]
    arrivals = [Arrival(s, f"{s.key}#0", 0.0) for s in sessions]

    async def main():
        send = FakeSend(latency_s=0.02)
        send.clock0 = time.monotonic()
        asyncio.get_running_loop().call_later(0.5, os.kill, os.getpid(), signal.SIGINT)
        return await replay(arrivals, send, clock0=send.clock0)

    result = asyncio.run(main())
    assert result.interrupted and result.wall_s < 3
    finished = [t for c in result.conversations for t in c.turns]
    assert finished and all(t.finished for t in finished) and not any(c.finished for c in result.conversations)


# --- the report -------------------------------------------------------------------------------------


def test_stats_are_numpys_linear_percentiles_and_none_when_empty():
    assert stats(list(range(1, 101)), "x") == {"x_mean_s": 50.5, "x_p50_s": 50.5, "x_p99_s": pytest.approx(99.01)}
    assert stats([2.0], "y") == {"y_mean_s": 2.0, "y_p50_s": 2.0, "y_p99_s": 2.0}
    assert stats([], "z") == {"z_mean_s": None, "z_p50_s": None, "z_p99_s": None}


def _record(conversation: str, arrival: float, turns: list[TurnRecord], planned: int | None = None):
    record = ConversationRecord(conversation, conversation.split("#")[0], arrival, planned or len(turns), turns, True)
    record.end_s = max((t.end_s for t in turns if t.end_s is not None), default=arrival)
    return record


SETTINGS = {**LoadgenOptions("http://h:1").settings(), "max_tokens": 100, "sessions": 2}


def test_report_counts_turns_and_conversations_and_is_valid_json(tmp_path):
    a = _record("a#0", 0.0, [TurnRecord(0, 0.0, 5, 0.5, 1.0, 10, 5, "stop"),
                             TurnRecord(1, 3.0, 7, 0.1, 1.0, 20, 6, "stop"),  # one short of its target
                             TurnRecord(2, 6.0, 500, 0.3, 2.0, 30, 100, "length")])  # the cap: exact
    b = _record("b#1", 1.0, [TurnRecord(0, 1.0, 4, 0.4, 1.0, 10, 4, "stop"),
                             TurnRecord(1, 4.0, 4, error="HTTP 500: boom")], planned=3)
    report = build_report(SETTINGS, {"model": "m"}, [a, b], wall_s=9.0, interrupted=False)
    turns, convs = report["turns"], report["conversations"]
    assert (turns["sent"], turns["finished"], turns["failed"], turns["exact_length"]) == (5, 4, 1, 3)
    assert turns["e2e_mean_s"] == pytest.approx(1.25) and turns["followups"] == 2
    assert turns["followup_ttft_mean_s"] == pytest.approx(0.2) and turns["ttft_mean_s"] == pytest.approx(0.325)
    assert turns["span_s"] == 8.0 and turns["per_s"] == 0.5 and turns["output_tokens_per_s"] == 115 / 8
    assert (convs["started"], convs["finished"], convs["failed"], convs["unfinished"]) == (2, 1, 1, 0)
    assert convs["e2e_mean_s"] == 8.0 and convs["followup_ttft_p50_s"] == pytest.approx(0.2)
    assert report["errors"] == {"HTTP 500: boom": 1} and report["interrupted"] is False
    path = tmp_path / "sub" / "report.json"
    write_report(path, report)
    assert json.loads(path.read_text()) == report


def test_an_empty_report_has_none_not_nan(tmp_path):
    unstarted = ConversationRecord("a#0", "a", 3.0, 2)
    report = build_report(SETTINGS, {}, [unstarted], wall_s=1.0, interrupted=True)
    assert report["turns"]["e2e_mean_s"] is None and report["conversations"]["per_s"] is None
    assert report["records"] == [] and report["interrupted"]
    write_report(tmp_path / "r.json", report)
    assert "NaN" not in (tmp_path / "r.json").read_text()


def test_the_plot_is_a_png(tmp_path):
    from marsched.loadgen.plot import plot_report

    a = _record("a#0", 0.0, [TurnRecord(0, 0.0, 5, 0.5, 1.0, 10, 5, "stop"), TurnRecord(1, 3.0, 4, error="x")])
    plot_report(build_report(SETTINGS, {"model": "m"}, [a], wall_s=4.0, interrupted=False), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the request's fields ---------------------------------------------------------------------------------


def test_the_turns_fields_keep_the_target_out_of_the_schedulers_key():
    xargs = turn_xargs(77, "conv#3")
    assert xargs[REPLY_TOKENS_KEY] == 77 and json.loads(xargs["marsched"]) == {"conversation": "conv#3"}
    assert turn_xargs(5, None) == {REPLY_TOKENS_KEY: 5}
    assert json.loads(turn_xargs(5, "p", retain=False)["marsched"]) == {"conversation": "p", "retain": False}
    oracle = turn_xargs(77, "conv#3", predicted=77)  # the diagnostic tells the scheduler the length
    assert oracle[REPLY_TOKENS_KEY] == 77
    assert json.loads(oracle["marsched"]) == {"conversation": "conv#3", "predicted": 77}
    assert json.loads(turn_xargs(5, None, predicted=5)["marsched"]) == {"predicted": 5}
    for bad in (0, -3, 2.0, True, "5", None, 10**9):
        with pytest.raises(ValueError, match=REPLY_TOKENS_KEY):
            check_reply_target(bad)


def test_base_url_accepts_the_root_or_v1_and_refuses_what_is_no_url():
    assert base_url("http://h:8000/") == base_url("http://h:8000/v1") == "http://h:8000"
    for bad in ("localhost:8000", "ftp://h", "http://", "http://h:port"):
        with pytest.raises(ValueError, match="URL"):
            base_url(bad)


# --- the command against a fake server ---------------------------------------------------------------


class FakeServer:
    """An OpenAI-compatible server in a thread: /v1/models and streamed /v1/completions. With
    `force`, a reply has the asked length (as the bench processor makes it), else `max_tokens`."""

    def __init__(self, force: bool = True, fail_every: int = 0, models_status: int = 200,
                 models: tuple[str, ...] = ("fake-model",), delay_s: float = 0.0) -> None:
        self.force, self.fail_every, self.models_status, self.models, self.delay_s = (
            force, fail_every, models_status, models, delay_s)
        self.bodies: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != "/v1/models":
                    return self._json(404, {"error": {"message": "not found"}})
                if server.models_status != 200:
                    return self._json(server.models_status, {"error": {"message": "models broke"}})
                self._json(200, {"object": "list", "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "t", "max_model_len": 2048}
                    for m in server.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.bodies.append(body)
                if server.fail_every and len(server.bodies) % server.fail_every == 0:
                    return self._json(500, {"error": {"message": "engine fell over", "type": "x", "code": 500}})
                target = body.get("vllm_xargs", {}).get(REPLY_TOKENS_KEY)
                n = min(target, body["max_tokens"]) if server.force and target else body["max_tokens"]
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                time.sleep(server.delay_s)
                for i in range(n):
                    chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "text": " w", "logprobs": None,
                                          "finish_reason": ("stop" if n == target else "length") if i == n - 1
                                          else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                usage = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"], "choices": [],
                         "usage": {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                                   "total_tokens": n}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server(request):
    server = FakeServer(**getattr(request, "param", {}))
    yield server
    server.close()


def loadgen(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marsched.cli", "loadgen", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


SHORT = ("--workload", "claude-code", "--token-scale", "0.002", "--rate", "2", "--duration", "2", "--max-turns", "3",
         "--max-gap-s", "0.1", "--seed", "3")


def test_the_command_writes_the_report_and_the_plot(fake_server, tmp_path):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    run = loadgen(fake_server.url, *SHORT, "--max-tokens", "64", "--out", str(out), "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "marsched.loadgen/1" and report["server"]["model"] == "fake-model"
    assert report["server"]["reply_lengths_forced"] is True and report["server"]["max_model_len"] == 2048
    assert report["settings"]["workload"] == "claude-code" and report["settings"]["token_scale"] == 0.002
    turns = report["turns"]
    assert turns["finished"] == turns["sent"] == turns["exact_length"] > 0 and turns["failed"] == 0
    assert report["conversations"]["finished"] == report["conversations"]["started"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "turns:" in run.stdout and "conversations:" in run.stdout
    bodies = fake_server.bodies[1:]  # after the probe
    assert {b["max_tokens"] for b in bodies} == {64} and all("seed" not in b and "ignore_eos" not in b for b in bodies)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    conversations = {json.loads(b["vllm_xargs"]["marsched"])["conversation"] for b in bodies}
    assert conversations == {c["conversation"] for c in report["records"]}


def test_conversation_keys_can_be_left_out(fake_server, tmp_path):
    run = loadgen(fake_server.url, *SHORT, "--no-conversation-keys", "--out", str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stderr
    assert all(set(b["vllm_xargs"]) == {REPLY_TOKENS_KEY} for b in fake_server.bodies)


def test_oracle_predictions_send_each_replys_length_capped_at_max_tokens_and_say_so(fake_server, tmp_path):
    out = tmp_path / "r.json"
    run = loadgen(fake_server.url, "--turn-chars", "400", "--max-turns", "2", "--rate", "2", "--duration", "2",
                  "--max-gap-s", "0.1", "--max-tokens", "100", "--oracle-predictions", "--out", str(out))
    assert run.returncode == 0, run.stderr
    bodies = fake_server.bodies[1:]  # after the probe, which predicts nothing
    assert "predicted" not in json.loads(fake_server.bodies[0]["vllm_xargs"]["marsched"])
    sent = [(b["vllm_xargs"][REPLY_TOKENS_KEY], json.loads(b["vllm_xargs"]["marsched"])["predicted"]) for b in bodies]
    assert sent and all(predicted == min(target, 100) for target, predicted in sent)
    assert any(target > 100 for target, _ in sent) and any(target < 100 for target, _ in sent)
    assert json.loads(out.read_text())["settings"]["oracle_predictions"] is True


def test_each_conversations_last_turn_tells_the_server_to_keep_nothing(fake_server, tmp_path):
    out = tmp_path / "r.json"
    run = loadgen(fake_server.url, "--turn-chars", "400", "--max-turns", "3", "--rate", "2", "--duration", "2",
                  "--max-gap-s", "0.1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    by_conversation: dict[str, list[bool]] = {}
    for body in fake_server.bodies[1:]:  # after the probe
        keys = json.loads(body["vllm_xargs"]["marsched"])
        by_conversation.setdefault(keys["conversation"], []).append(keys.get("retain", True))
    assert by_conversation and any(len(kept) > 1 for kept in by_conversation.values())
    assert all(kept == [True] * (len(kept) - 1) + [False] for kept in by_conversation.values())


def test_failed_requests_are_counted_not_fatal(fake_server, tmp_path):
    out = tmp_path / "r.json"
    process = subprocess.Popen([sys.executable, "-m", "marsched.cli", "loadgen", fake_server.url, *SHORT, "--out",
                                str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not fake_server.bodies:  # the probe goes through; then every third turn fails
        time.sleep(0.05)
    fake_server.fail_every = 3
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    report = json.loads(out.read_text())
    assert report["turns"]["failed"] > 0 and report["conversations"]["failed"] > 0
    assert report["errors"] and all(e.startswith("HTTP 500: engine fell over") for e in report["errors"])


@pytest.mark.parametrize("fake_server", [{"force": False}], indirect=True)
def test_a_server_that_does_not_force_lengths_gets_a_warning(fake_server, tmp_path):
    run = loadgen(fake_server.url, *SHORT, "--max-tokens", "8", "--out", str(tmp_path / "r.json"))
    assert run.returncode == 0 and "--bench-reply-lengths" in run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["server"]["reply_lengths_forced"] is False


@pytest.mark.parametrize("fake_server", [{"delay_s": 0.3}], indirect=True)
def test_ctrl_c_writes_what_finished_marked_interrupted(fake_server, tmp_path):
    out = tmp_path / "r.json"
    process = subprocess.Popen([sys.executable, "-m", "marsched.cli", "loadgen", fake_server.url, "--workload",
                                "claude-code", "--token-scale", "0.002", "--rate", "5", "--duration", "30",
                                "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(fake_server.bodies) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["turns"]["finished"] > 0
    assert report["conversations"]["unfinished"] > 0 and "interrupted" in stderr


@pytest.mark.parametrize("fake_server, message", [
    ({"models_status": 500}, "HTTP 500: models broke"),
    ({"models": ()}, "lists no model"),
], indirect=["fake_server"])
def test_a_broken_server_is_one_line_and_exit_2(fake_server, message):
    run = loadgen(fake_server.url, *SHORT)
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_model_the_server_does_not_serve(fake_server):
    run = loadgen(fake_server.url, *SHORT, "--model", "other")
    assert run.returncode == 2 and "--model other: the server does not serve it; it serves fake-model" in run.stderr


def test_a_url_that_does_not_answer(tmp_path):
    from marsched.serve.launch import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    run = loadgen(url, *SHORT, "--out", str(tmp_path / "r.json"))
    assert run.returncode == 2 and "no answer" in run.stderr and url in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args, message", [
    (("--rate", "0"), "--rate 0: give a finite number > 0"),
    (("--duration", "nan"), "--duration nan"),
    (("--workload", "nope"), "--workload 'nope': give one of agent-text"),
    (("--token-scale", "0.5"), "--token-scale 0.5: only for --workload claude-code"),
    (("--turn-chars", "-1"), "--turn-chars -1: give 0"),
    (("--workload", "claude-code", "--turn-chars", "100"), "--turn-chars 100: only for --workload agent-text"),
    (("--seed", "-1"), "--seed -1"),
    (("--max-turns", "-2"), "--max-turns -2"),
    (("--max-tokens", "0"), "--max-tokens 0"),
    (("--max-concurrency", "-1"), "--max-concurrency -1: give 0"),
    (("--turn-chars", "400", "--reply-chars", "-1"), "--reply-chars -1: give 0"),
    (("--reply-chars", "100"), "--reply-chars 100: only with --turn-chars"),
    (("--gap-scale", "-1"), "--gap-scale -1"),
    (("--max-gap-s", "-1"), "--max-gap-s -1"),
    (("--rate", "0.001", "--duration", "1"), "no conversation arrives"),
    (("--sessions", "some"), "--sessions 'some': give one of all, held-out"),
    (("--workload", "claude-code", "--sessions", "held-out"), "--sessions held-out: only for --workload agent-text"),
    (("--out", "/"), "--out /: is a directory"),
])
def test_bad_flags_are_one_line_and_exit_2(args, message):
    run = loadgen("http://127.0.0.1:9", *args)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_held_out_sessions_are_exactly_those_the_agent_head_never_trained_on():
    from marsched.loadgen.options import LoadgenOptions, load_sessions

    record = json.loads((Path(__file__).parents[1] / "src/marsched/predict/heads/agent/train.json").read_text())
    held = load_sessions(LoadgenOptions("http://x", sessions="held-out"))
    assert sorted(s.key for s in held) == sorted(record["held_out_sessions"]) and len(held) == 14
    assert not {s.key for s in held} & set(record["train_sessions"])
    miniswe = load_sessions(LoadgenOptions("http://x", workload="agent-text:miniswe", sessions="held-out"))
    assert miniswe and {s.key for s in miniswe} < {s.key for s in held}


def test_a_bad_url_is_one_line_and_exit_2():
    run = loadgen("localhost:8000")
    assert run.returncode == 2 and "URL 'localhost:8000': give the server's address" in run.stderr


# --- the target reaches the bench processor, and nothing the scheduler reads (vLLM, no engine) ----------


def _ints(value, seen=None) -> list[int]:
    """Every int inside `value`: dataclasses, containers, mocks' recorded calls; JSON text parsed."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, float):
        return [int(value)] if math.isfinite(value) and value == int(value) else []
    if isinstance(value, str):
        try:
            return _ints(json.loads(value), seen) if value[:1] in "[{" else []
        except ValueError:
            return []
    if isinstance(value, mock.Mock):
        return [i for call in value.mock_calls for i in _ints((call.args, call.kwargs), seen)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [i for f in dataclasses.fields(value) for i in _ints(getattr(value, f.name), seen)]
    if isinstance(value, dict):
        return [i for item in value.items() for i in _ints(item, seen)]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [i for item in value for i in _ints(item, seen)]
    return []


def test_no_scheduler_input_carries_the_reply_length():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.request import Request

    from marsched.loadgen.reply_length import _target_of
    from marsched.vllm.call_steps import CallSteps
    from marsched.vllm.metadata import decode

    target, prompt_tokens, max_model_len = 777, 17, 8192
    # The body the client sends, through vLLM's front end as the server builds a request from it.
    body = {"model": "m", "prompt": "x", "max_tokens": 4096, "stream": True,
            "stream_options": {"include_usage": True}, "vllm_xargs": turn_xargs(target, "conv#5")}
    params = CompletionRequest(**body).to_sampling_params(min(4096, max_model_len - prompt_tokens))
    params.update_from_generation_config({}, eos_token_id=2)
    request = Request("req-1", [5] * prompt_tokens, params, None)
    assert _target_of(params) == target and target in _ints(params.extra_args)  # the bench reads it

    meta = decode(params)  # what the scheduler decodes
    assert meta.conversation == "conv#5" and target not in _ints(meta)
    # The scheduler's arrival step, with its collaborators recorded: the plan, the workload request
    # the policy predicts from, and everything handed on.
    steps = object.__new__(CallSteps)
    steps.mars_policy, steps._keeper, steps._gaps, steps.lifecycle = (mock.MagicMock() for _ in range(4))
    steps._keeper.claim.return_value = None
    from marsched.vllm.programs import ProgramLedger

    steps._programs = ProgramLedger()
    steps.mars_config = SimpleNamespace(front_end=False, allow_request_strategy=True)
    steps._tracked, steps._sync, steps._start_segment = {}, mock.MagicMock(), mock.MagicMock()
    steps._on_arrival(request)
    tracked = steps._tracked["req-1"]
    assert tracked.conversation == "conv#5" and tracked.plan[0].output_tokens == 4096
    assert tracked.progress.request.segments[0].output_tokens == 4096  # max_tokens: the same for every turn
    for read in (tracked, steps.mars_policy, steps._keeper, steps._gaps, steps.lifecycle, steps._sync,
                 steps._start_segment):
        assert target not in _ints(read)


EOS, OTHER_STOP, VOCAB = 2, 7, 16


def _params(target: int | None):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=100, extra_args={REPLY_TOKENS_KEY: target} if target else None,
                            stop_token_ids=[OTHER_STOP])
    params.update_from_generation_config({}, eos_token_id=EOS)
    return params


def _logits(rows: int, favour: int):
    import torch

    logits = torch.zeros(rows, VOCAB)
    logits[:, favour] = 5.0  # greedy picks `favour` unless the processor forbids it
    logits[:, OTHER_STOP] = 4.0
    return logits


@pytest.mark.parametrize("target", [1, 2, 9])
@pytest.mark.parametrize("favour", [EOS, 11])  # a model that wants to stop at once; one that never would
def test_v1_processor_ends_the_reply_exactly_at_the_target(target, favour):
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate

    from marsched.loadgen.reply_length import BenchReplyLength

    processor = BenchReplyLength(None, torch.device("cpu"), False)
    assert not processor.is_argmax_invariant()
    outputs: list[list[int]] = [[], []]
    processor.update_state(BatchUpdate(2, [], [(0, _params(target), [1, 2], outputs[0]),
                                               (1, _params(None), [1, 2], outputs[1])], []))
    for _ in range(target + 3):
        logits = processor.apply(_logits(2, favour))
        for row in range(2):
            if not outputs[row] or outputs[row][-1] not in (EOS, OTHER_STOP):
                outputs[row].append(int(torch.argmax(logits[row])))
        processor.update_state(None)
    assert len(outputs[0]) == target and outputs[0][-1] == EOS and EOS not in outputs[0][:-1]
    assert outputs[1][0] == favour  # a request without a target is left alone
    assert OTHER_STOP not in outputs[0]  # the model's other stop ids are held back too


def test_v1_processor_follows_moves_and_removals():
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from marsched.loadgen.reply_length import BenchReplyLength

    processor = BenchReplyLength(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(2, [], [(0, _params(1), [1], [])], []))
    processor.update_state(BatchUpdate(2, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    logits = processor.apply(_logits(2, 11))
    assert int(torch.argmax(logits[1])) == EOS and int(torch.argmax(logits[0])) == 11
    processor.update_state(BatchUpdate(2, [1], [], []))
    assert int(torch.argmax(processor.apply(_logits(2, 11))[1])) == 11


@pytest.mark.parametrize("target", [1, 5])
def test_v2_processor_ends_the_reply_exactly_at_the_target(target):
    pytest.importorskip("vllm")
    import numpy as np
    import torch

    from marsched.loadgen.reply_length import BenchReplyLength

    prompt_len = torch.tensor([0, 6, 0, 3], dtype=torch.int32)
    states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=4, prompt_len=SimpleNamespace(gpu=prompt_len))
    processor = BenchReplyLength(None, states)
    assert processor.add_request(1, _params(target)) and not processor.add_request(3, _params(None))
    processor.apply_staged_writes()
    generated = {1: [], 3: []}
    for _ in range(target + 2):
        slots = [s for s in (1, 3) if not generated[s] or generated[s][-1] != EOS]
        if not slots:
            break
        ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots),
                              pos=torch.tensor([int(prompt_len[s]) - 1 + len(generated[s]) for s in slots]))
        logits = processor.apply(_logits(len(slots), EOS), ctx)
        for row, slot in enumerate(slots):
            generated[slot].append(int(torch.argmax(logits[row])))
    assert len(generated[1]) == target and generated[1][-1] == EOS and EOS not in generated[1][:-1]
    assert generated[3] == [EOS]  # no target: it stops where the model wants


def test_a_bad_target_is_refused_in_the_front_end():
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from marsched.loadgen.reply_length import BenchReplyLength

    BenchReplyLength.validate_params(SamplingParams(extra_args={REPLY_TOKENS_KEY: 4}))
    BenchReplyLength.validate_params(SamplingParams())
    with pytest.raises(VLLMValidationError, match=REPLY_TOKENS_KEY):
        BenchReplyLength.validate_params(SamplingParams(extra_args={REPLY_TOKENS_KEY: 0}))


def test_serve_bench_reply_lengths_loads_the_processor_beside_the_validator():
    from marsched.serve.launch import BENCH_REPLY_LENGTH, VALIDATOR, ServeOptions, describe, vllm_command

    command = vllm_command(ServeOptions("m", bench_reply_lengths=True, vllm_args=("--logits-processors", "a:B")))
    at = command.index("--logits-processors")
    assert command[at + 1:at + 4] == [VALIDATOR, BENCH_REPLY_LENGTH, "a:B"]
    assert command.count("--logits-processors") == 1
    assert BENCH_REPLY_LENGTH not in vllm_command(ServeOptions("m"))
    assert BENCH_REPLY_LENGTH == "marsched.loadgen.reply_length:BenchReplyLength"
    assert "bench reply lengths" in describe(ServeOptions("m", bench_reply_lengths=True), {})


def test_the_client_drops_an_idle_connection_before_vllms_server_closes_it():
    vllm_envs = pytest.importorskip("vllm.envs")
    assert KEEPALIVE_S < vllm_envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    client = open_client("http://127.0.0.1:1", 7.0, "x")
    pool = client._client._transport._pool  # httpx's pool, as the client was given it
    assert pool._keepalive_expiry == KEEPALIVE_S and client.max_retries == 0 and client.timeout == 7.0
