"""The gap between a conversation's turns, learned per tool: the estimator (`policy.retention`), the
`tool` field (`vllm.metadata`), the hint from the API server to the scheduler (`vllm.tool_hints`), the
kept turn decided again (`vllm.retention`, `vllm.conversation_steps`) and the middleware that sends
the hint (`serve.tool_gaps`), without an engine. Live: test_serve_tool_gaps.py."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from types import SimpleNamespace

import pytest

from marsched.policy import CostModel, EngineLoad, Strategy, make_policy
from marsched.policy.retention import (GapEstimator, GapSource, RetentionRule, ToolGaps, parse_retention,
                                       shrunk_gap_s)
from marsched.serve.tool_gaps import ReplyWatch, ToolGapsMiddleware
from marsched.vllm.metadata import MAX_TOOL_CHARS, MetadataError, parse, tool_name
from marsched.vllm.programs import ProgramLedger
from marsched.vllm.retention import HOST_KEY_PREFIX, ConversationKeeper
from marsched.vllm.tool_hints import (CALLED_PREFIX, MAX_HINT_TOOLS, TOOL_PREFIX, called_id, read_called, ConversationTools, hint_id, read_hint,
                                      send_tool_hint)

# --- the estimator --------------------------------------------------------------------------------


def tool(*gaps: float) -> ToolGaps:
    gaps_of = ToolGaps()
    for gap in gaps:
        gaps_of.observe(gap)
    return gaps_of


def test_the_shrinkage_formula():
    assert shrunk_gap_s(ToolGaps(), 3.0) == pytest.approx(3.0)  # no samples: the prior
    # one sample of 8 s against a 2 s prior, k = 1: half each in log space
    assert shrunk_gap_s(tool(8.0), 2.0) == pytest.approx(4.0)
    # n samples weigh n / (n + k)
    assert shrunk_gap_s(tool(8.0, 8.0, 8.0), 1.0, prior_weight=1.0) == pytest.approx(math.exp(3 / 4 * math.log(8)))
    assert shrunk_gap_s(tool(8.0, 8.0, 8.0), 1.0, prior_weight=3.0) == pytest.approx(math.exp(1 / 2 * math.log(8)))
    assert shrunk_gap_s(tool(0.5, 2.0), 1.0) == pytest.approx(1.0)  # the tool's own mean is geometric
    assert 0 < shrunk_gap_s(tool(0.0), 1.0) < 1e-2  # an immediate follow-up stays finite in log space
    many = tool(*[0.01] * 200)
    assert shrunk_gap_s(many, 100.0) == pytest.approx(0.01, rel=0.1)  # its own gaps take over


def test_each_tool_learns_its_own_gap_from_the_global_prior():
    gaps = GapEstimator()
    assert gaps.predict(None, ("search",)) == gaps.global_s == 1.0  # nothing seen: the 1 s prior
    for _ in range(20):
        gaps.observe(0.2, ("calc",))
        gaps.observe(5.0, ("search",))
    assert gaps.predict(None, ("calc",)) == pytest.approx(0.2, rel=0.1)
    assert gaps.predict(None, ("search",)) == pytest.approx(5.0, rel=0.1)
    assert gaps.predict(None) == gaps.global_s == pytest.approx(1.0, rel=0.1)  # all gaps together
    assert gaps.predict(None, ("never-seen",)) == gaps.global_s
    assert gaps.predict(7.5, ("calc",)) == 7.5  # the client's tool_s wins
    # Calls in parallel: the follow-up waits for the slowest; its gap goes to that tool alone.
    assert gaps.predict(None, ("calc", "search")) == gaps.predict(None, ("search",))
    before = gaps.snapshot()
    gaps.observe(6.0, ("calc", "search"))
    after = gaps.snapshot()
    assert after["calc"]["samples"] == before["calc"]["samples"] == 20
    assert after["search"]["samples"] == 21
    assert set(after) == {"calc", "search"} and after["search"]["estimate_s"] == pytest.approx(5.0, rel=0.1)


def test_a_gap_without_a_tool_moves_only_the_global_estimate():
    gaps = GapEstimator()
    gaps.observe(0.5, ("calc",))
    calc = gaps.predict(None, ("calc",))
    gaps.observe(100.0)
    assert gaps.snapshot()["calc"]["samples"] == 1
    assert gaps.global_s > 1.0 and gaps.predict(None, ("calc",)) > calc  # its prior moved


def test_the_tools_tracked_are_bounded_and_the_least_recently_observed_goes():
    gaps = GapEstimator(max_tools=3)
    for name in ("a", "b", "c"):
        gaps.observe(1.0, (name,))
    gaps.observe(1.0, ("a",))  # a is recent again
    gaps.observe(1.0, ("d",))
    assert list(gaps.snapshot()) == ["c", "a", "d"]  # b, least recently observed, went
    for index in range(1000):
        gaps.observe(1.0, (f"t{index}",))
    assert len(gaps.snapshot()) == 3
    assert GapEstimator().max_tools == 256


# --- the `tool` field --------------------------------------------------------------------------------


def test_the_tool_field_names_the_tool_whose_result_the_turn_carries():
    meta = parse(json.dumps({"plan": [[4, None, 0, 0]], "conversation": "c", "tool": "get_weather"}))
    assert meta.tool == "get_weather" and meta.to_dict()["tool"] == "get_weather"
    assert parse(meta.to_vllm_xargs()["marsched"]) == meta
    assert parse({"tool": "web search/v2"}).tool == "web_search_v2"  # named as a reply's call would be
    assert parse({"tool": "天气"}).tool == "天气"
    assert parse({}).tool is None and "tool" not in parse({}).to_dict()


@pytest.mark.parametrize("value", [3, True, "", "x" * (MAX_TOOL_CHARS + 1), ["a"], {"name": "a"}])
def test_a_bad_tool_field_is_named(value):
    with pytest.raises(MetadataError, match=r"^marsched\.tool: must be a string of 1 to 64 characters") as raised:
        parse({"conversation": "c", "tool": value})
    assert raised.value.field == "marsched.tool"


def test_tool_names_are_sanitised_and_bounded():
    assert tool_name("get_weather") == "get_weather"
    assert tool_name("a,b\x1fc d/e") == "a_b_c_d_e"  # never the hint's separators
    assert tool_name("functions.get-time") == "functions.get-time"
    assert tool_name("x" * 100) == "x" * MAX_TOOL_CHARS


# --- the hint -----------------------------------------------------------------------------------------


def test_a_hint_carries_the_conversation_and_the_distinct_names():
    hint = hint_id("chat-42", ["get_weather", "calc", "get_weather"])
    assert hint == f"{TOOL_PREFIX}chat-42\x1fget_weather,calc"
    assert read_hint(hint[len(TOOL_PREFIX):]) == ("chat-42", ("get_weather", "calc"))
    # A conversation id may hold the separators; the names never do.
    odd = hint_id("a\x1fb,c", ["x,y"])
    assert read_hint(odd[len(TOOL_PREFIX):]) == ("a\x1fb,c", ("x_y",))
    many = hint_id("c", [f"t{i}" for i in range(50)])
    assert read_hint(many[len(TOOL_PREFIX):])[1] == tuple(f"t{i}" for i in range(MAX_HINT_TOOLS))
    assert len(hint_id("c" * 256, ["x" * 500] * 50)) <= len(TOOL_PREFIX) + 256 + 1 + MAX_HINT_TOOLS * 65


@pytest.mark.parametrize("conversation, names", [("", ["a"]), ("x" * 257, ["a"]), ("a/b", ["a"]), ("c", []),
                                                  ("c", [""]), ("c", [None, 3])])
def test_nothing_to_tell_is_no_hint(conversation, names):
    assert hint_id(conversation, names) is None


@pytest.mark.parametrize("text", ["no-separator", "\x1fcalc", "c\x1f", "c\x1f,,", "a/b\x1fcalc", "x" * 300 + "\x1fa"])
def test_a_malformed_hint_is_dropped(text):
    assert read_hint(text) is None


def test_the_hint_goes_through_the_abort_path_to_every_rank():
    sent = []

    async def abort(ids):
        sent.append(list(ids))

    engine = SimpleNamespace(engine_core=SimpleNamespace(abort_requests_async=abort))
    assert asyncio.run(send_tool_hint(engine, "c1", ["calc"]))
    assert sent == [[f"{TOOL_PREFIX}c1\x1fcalc"]]
    assert not asyncio.run(send_tool_hint(engine, "c1", []))
    assert len(sent) == 1


def test_under_data_parallelism_the_hint_reaches_every_rank():
    pytest.importorskip("vllm")
    from test_data_parallel_affinity import dp_client

    core, sent = dp_client({"r1": 1})  # vLLM's own data-parallel client, which drops ids it did not place
    asyncio.run(send_tool_hint(SimpleNamespace(engine_core=core), "chat-1", ["calc"]))
    assert sent == [(0, [f"{TOOL_PREFIX}chat-1\x1fcalc"]), (1, [f"{TOOL_PREFIX}chat-1\x1fcalc"])]


def test_conversation_tools_attribute_each_gap_once_and_remember_the_last_tool():
    tools = ConversationTools()
    assert not tools.hinted("c", ("calc",))  # never ran here (another rank's): nothing to learn
    assert tools.ended("c") == ()  # no previous tool yet
    assert tools.hinted("c", ("calc",))
    assert tools.arrived("c", stated="other") == ("calc",)  # the reply's tools win over the stated one
    assert not tools.hinted("c", ("late",))  # after the follow-up: would be the next gap's
    assert tools.ended("c") == ("calc",)  # the default until the hint comes
    assert tools.arrived("c", stated="search") == ("search",)  # no hint (a completion): the field
    assert tools.ended("c") == ("search",)
    assert tools.arrived("c", stated=None) == ()  # nothing known: the global estimate only
    assert tools.ended("c") == ("search",)  # still the conversation's last tool
    bounded = ConversationTools(remembered=2)
    for name in ("a", "b", "c"):
        bounded.ended(name)
    assert len(bounded) == 2 and not bounded.hinted("a", ("x",))


# --- a kept turn decided again ---------------------------------------------------------------------------


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.block_hash, self.ref_cnt = block_id, f"h{block_id}", 1


class Pool:
    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1

    def evict_blocks(self, ids):
        pass


class Swapper:
    def __init__(self) -> None:
        self.out, self.dropped = {}, []
        self.snapshot_dirty = False

    def queue_swap_out(self, key, ids, tokens):
        self.out[key] = (ids, tokens)

    def cancel_swap_out(self, key):
        return self.out.pop(key, None) is not None

    def drop(self, key):
        self.dropped.append(key)


def keeper_with(strategy: Strategy, swapper=None) -> tuple[ConversationKeeper, list[Block]]:
    keeper = ConversationKeeper(Pool(), 4, swapper)
    blocks = [Block(i) for i in range(3)]
    assert keeper.keep("c", "r1", list(range(12)), 12, blocks, strategy, 0.0, 60.0) is not None
    return keeper, blocks


def test_a_preserve_can_become_a_swap_or_a_discard():
    swapper = Swapper()
    keeper, blocks = keeper_with(Strategy.PRESERVE, swapper)
    assert keeper.change("c", Strategy.PRESERVE) is Strategy.PRESERVE and keeper.stats.redecided == 0
    assert keeper.change("c", Strategy.SWAP) is Strategy.SWAP
    assert swapper.out == {HOST_KEY_PREFIX + "r1": ([0, 1, 2], 12)}  # the pinned blocks are copied out
    assert keeper.kept["c"].strategy is Strategy.SWAP and keeper.snapshot()["retention_redecided"] == 1
    # A Swap does not become a Preserve again; it can be discarded.
    assert keeper.change("c", Strategy.PRESERVE) is Strategy.SWAP
    assert keeper.change("c", Strategy.DISCARD) is Strategy.DISCARD
    assert "c" not in keeper.kept and all(b.ref_cnt == 1 for b in blocks)  # unpinned
    assert keeper.stats.released == 0 and keeper.stats.redecided == 2
    assert keeper.change("c", Strategy.PRESERVE) is None  # a discarded turn cannot come back


def test_without_the_swap_connector_a_preserve_stays():
    keeper, _ = keeper_with(Strategy.PRESERVE)
    assert keeper.change("c", Strategy.SWAP) is Strategy.PRESERVE and keeper.stats.redecided == 0


# --- the scheduler's steps, on fakes ---------------------------------------------------------------------

COST = CostModel(seconds_per_token=2e-5, seconds_per_iteration=0.01, token_budget=2048, swap_tokens_per_s=1e6)


@pytest.fixture
def steps():
    pytest.importorskip("vllm")
    from vllm.v1.request import RequestStatus

    from marsched.vllm.conversation_steps import ConversationSteps

    class Vllm:  # what `super()` reaches: vLLM's scheduler
        def finish_requests(self, request_ids, finished_status):
            self.passed.append((request_ids, finished_status))
            return []

    class Steps(ConversationSteps, Vllm):
        host_free = 10**6

        def _load(self):  # a running batch: moving a context stalls it, keeping one a moment costs little
            return EngineLoad(0.0, 50_000, 0.01, self.host_free)

        def _host_free_tokens(self):
            return self.host_free

        def _can_swap(self, request, load):
            return load.host_free_tokens >= request.num_computed_tokens

    made = Steps()
    made.mars_policy = make_policy("mars", COST)
    made._retention = RetentionRule()
    made._swapper = Swapper()
    made._keeper = ConversationKeeper(Pool(), 16, made._swapper)
    made._gaps, made._tools, made._programs = GapEstimator(), ConversationTools(), ProgramLedger()
    made._done, made._changed, made._input_queue, made.passed = {}, set(), None, []
    for _ in range(30):  # a calculator answers at once, a human in ten minutes
        made._gaps.observe(0.001, ("calc",))
        made._gaps.observe(600.0, ("ask_human",))

    def finish(conversation, rid, tokens=2000, tool_s=None, override=None):
        blocks = [Block(i) for i in range(tokens // 16)]
        made.kv_cache_manager = SimpleNamespace(get_blocks=lambda _: SimpleNamespace(blocks=(blocks,)))
        request = SimpleNamespace(request_id=rid, num_computed_tokens=tokens, all_token_ids=list(range(tokens)),
                                  status=RequestStatus.FINISHED_STOPPED)
        tracked = SimpleNamespace(conversation=conversation, tool_s=tool_s, override=override, rid=rid,
                                  retention=None)
        made._keep_conversation(request, tracked)
        made._done[rid] = {"retention": tracked.retention.to_dict()}
        return tracked

    made.finish = finish
    return made


def hint(steps, conversation, *names):
    assert steps.finish_requests([hint_id(conversation, names)], "aborted") == []


def test_until_the_hint_the_previous_tool_decides_then_the_hint_decides_again(steps):
    steps._tools.ended("chat")
    steps._tools.arrived("chat", "calc")  # its previous gap followed the calculator
    tracked = steps.finish("chat", "turn-1")
    assert tracked.retention.source is GapSource.PREVIOUS and tracked.retention.tools == ("calc",)
    assert tracked.retention.strategy is Strategy.PRESERVE and tracked.retention.gap_s < 0.01
    hint(steps, "chat", "ask_human")  # this reply asked a human: ten minutes
    kept = steps._keeper.kept["chat"]
    assert kept.strategy is Strategy.SWAP and steps._swapper.out  # the copy out is queued
    shown = steps._done["turn-1"]["retention"]
    assert shown == {"strategy": "swap", "gap_s": steps._gaps.predict(None, ("ask_human",)), "gap_source": "hint",
                     "tools": ["ask_human"], "redecided": True}
    assert shown["gap_s"] > 300
    assert "turn-1" in steps._changed and steps._swapper.snapshot_dirty
    # The follow-up's gap is the human's.
    assert steps._tools.arrived("chat", stated="calc") == ("ask_human",)


def test_no_room_on_the_host_makes_a_long_tool_discard_and_a_discard_stays(steps):
    steps.host_free = 0
    tracked = steps.finish("chat", "turn-1")
    assert tracked.retention.source is GapSource.GLOBAL and tracked.retention.strategy is Strategy.PRESERVE
    hint(steps, "chat", "ask_human")
    assert "chat" not in steps._keeper.kept and steps._done["turn-1"]["retention"]["strategy"] == "discard"
    hint(steps, "chat", "calc")  # a short tool after all: the blocks are not held any more
    assert "chat" not in steps._keeper.kept


@pytest.mark.parametrize("fields", [{"tool_s": 0.0}, {"override": Strategy.PRESERVE}])
def test_the_clients_tool_s_and_a_forced_strategy_are_not_decided_again(steps, fields):
    tracked = steps.finish("chat", "turn-1", **fields)
    assert tracked.retention.strategy is Strategy.PRESERVE
    assert tracked.retention.source is (GapSource.STATED if "tool_s" in fields else GapSource.GLOBAL)
    hint(steps, "chat", "ask_human")
    assert steps._keeper.kept["chat"].strategy is Strategy.PRESERVE
    assert steps._tools.arrived("chat", None) == ("ask_human",)  # its gap still goes to the tool


def test_other_rules_are_not_decided_again(steps):
    steps._retention = parse_retention("fixed:5")
    steps.finish("chat", "turn-1")
    hint(steps, "chat", "ask_human")
    assert steps._keeper.kept["chat"].strategy is Strategy.PRESERVE


def test_hints_are_taken_out_of_the_abort_message_and_a_failing_one_is_not_raised(steps):
    before = steps.finish("chat", "turn-1").retention.strategy

    def boom(conversation, strategy):
        raise RuntimeError("kaboom")

    steps._keeper.change = boom
    message = ["r1", hint_id("chat", ["ask_human"]), f"{TOOL_PREFIX}garbage", hint_id("elsewhere", ["calc"]), "r2"]
    assert steps.finish_requests(message, "aborted") == []
    assert steps.passed == [(["r1", "r2"], "aborted")]  # the rest goes on to vLLM's own
    assert steps._keeper.kept["chat"].strategy is before


# --- the middleware ---------------------------------------------------------------------------------------


def body(stream: bool = False, **meta) -> bytes:
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if meta:
        data["vllm_xargs"] = {"marsched": json.dumps(meta)}
    return json.dumps(data).encode()


def reply(*calls: str, finish: str = "tool_calls", n: int = 1) -> bytes:
    tool_calls = [{"id": f"call-{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
                  for i, name in enumerate(calls)]
    choices = [{"index": i, "message": {"role": "assistant", "content": None, "tool_calls": tool_calls},
                "finish_reason": finish} for i in range(n)]
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": choices}).encode()


def stream(*calls: str, finish: str = "tool_calls") -> list[bytes]:
    """vLLM's server-sent events of a reply calling `calls`, one event per body message."""
    def event(delta, finish_reason=None):
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""}), event({"content": "let me see"})]
    for i, name in enumerate(calls):
        events.append(event({"tool_calls": [{"index": i, "id": f"call-{i}", "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))
        events.append(event({"tool_calls": [{"index": i, "function": {"arguments": "{\"q\": 1}"}}]}))
    events.append(event({}, finish))
    return events + [b"data: [DONE]\n\n"]


class Engine:
    """An engine client whose engine core records the abort ids it is sent (or fails)."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[list[str]] = []
        self.fail = fail

    async def abort(self, ids):
        if self.fail:
            raise ConnectionError("engine core gone")
        self.sent.append(list(ids))


def serve(raw: bytes, messages: list[bytes], streamed: bool = False, engine: Engine | None = None,
          path: str = "/v1/chat/completions", status: int = 200, read_calls=None) -> dict:
    """`raw` through the middleware to an app answering `messages` (one body message each)."""
    engine = engine or Engine()
    seen: dict = {"body": b"", "sent": [], "app_body": None, "engine": engine}
    content_type = b"text/event-stream; charset=utf-8" if streamed else b"application/json"

    async def app(scope, receive, send):
        message = await receive()
        seen["app_body"] = message["body"]
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        for index, chunk in enumerate(messages):
            await send({"type": "http.response.body", "body": chunk, "more_body": index < len(messages) - 1})
        seen["hints_while_answering"] = list(engine.sent)

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        seen["sent"].append(message)
        if message["type"] == "http.response.body":
            seen["body"] += message.get("body", b"")

    async def run():
        fake = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(
            engine_core=SimpleNamespace(abort_requests_async=engine.abort)), marsched_completion_tools=read_calls))
        middleware = ToolGapsMiddleware(app)
        scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": fake}
        await middleware(scope, receive, send)
        await asyncio.gather(*middleware._hints)

    asyncio.run(run())
    seen["hints"] = engine.sent
    return seen


def test_a_non_streamed_reply_passes_unchanged_and_its_tools_are_told():
    answer = reply("get_weather", "calc", "get_weather")
    parts = [answer[:10], answer[10:50], answer[50:]]  # a body in several messages
    raw = body(conversation="chat-1")
    seen = serve(raw, parts)
    assert seen["app_body"] == raw and seen["body"] == answer
    assert [m.get("body") for m in seen["sent"][1:]] == parts  # each message as it came
    assert seen["hints"] == [[f"{TOOL_PREFIX}chat-1\x1fget_weather,calc"]]
    assert seen["hints_while_answering"] == []  # after the reply, not before


def test_a_streamed_reply_passes_unchanged_and_its_tools_are_told():
    events = stream("search", "calc")
    seen = serve(body(stream=True, conversation="chat-2"), events, streamed=True)
    assert seen["body"] == b"".join(events)
    assert seen["hints"] == [[f"{TOOL_PREFIX}chat-2\x1fsearch,calc"]]
    # Events split across body messages anywhere, and with CRLF line ends.
    joined = b"".join(events).replace(b"\n", b"\r\n")
    pieces = [joined[i:i + 7] for i in range(0, len(joined), 7)]
    seen = serve(body(stream=True, conversation="chat-3"), pieces, streamed=True)
    assert seen["body"] == joined and seen["hints"] == [[f"{TOOL_PREFIX}chat-3\x1fsearch,calc"]]


def test_a_named_tool_choice_ends_with_stop_and_is_told():
    assert serve(body(conversation="c"), [reply("calc", finish="stop")])["hints"] == [[f"{TOOL_PREFIX}c\x1fcalc"]]
    seen = serve(body(stream=True, conversation="c"), stream("calc", finish="stop"), streamed=True)
    assert seen["hints"] == [[f"{TOOL_PREFIX}c\x1fcalc"]]


@pytest.mark.parametrize("case", ["no conversation", "last turn", "no tool calls", "cut at length", "error status",
                                  "other path", "not json", "stream without calls", "stream cut at length"])
def test_no_hint_without_a_conversation_or_without_tool_calls(case):
    plain = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "tool_calls": []},
                                     "finish_reason": "stop"}]}).encode()
    raw, messages, streamed, options = body(conversation="c"), [reply("calc")], False, {}
    if case == "no conversation":
        raw = body()
    elif case == "last turn":
        raw = body(conversation="c", retain=False)
    elif case == "no tool calls":
        messages = [plain]
    elif case == "cut at length":
        messages = [reply("calc", finish="length")]
    elif case == "error status":
        options = {"status": 400}
    elif case == "other path":
        options = {"path": "/v1/completions"}
    elif case == "not json":
        raw = b"{not json"
    elif case == "stream without calls":
        messages, streamed = [e for e in stream() if b"tool_calls" not in e], True
    elif case == "stream cut at length":
        messages, streamed = stream("calc", finish="length"), True
    seen = serve(raw, messages, streamed=streamed, **options)
    assert seen["hints"] == [] and seen["body"] == b"".join(messages) and seen["app_body"] == raw


def test_a_failed_hint_is_logged_and_the_reply_is_whole(caplog):
    answer = reply("calc")
    with caplog.at_level(logging.WARNING, logger="marsched.serve.tool_gaps"):
        seen = serve(body(conversation="chat-9"), [answer], engine=Engine(fail=True))
    assert seen["body"] == answer
    assert "could not tell the scheduler the tools conversation chat-9 called (calc)" in caplog.text


def test_an_unreadable_reply_is_passed_on_and_tells_nothing():
    garbage = b'{"choices": [{"message": {"tool_calls": [' + b"x" * 100
    seen = serve(body(conversation="c"), [garbage])
    assert seen["body"] == garbage and seen["hints"] == []
    broken = [b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"function":{"name":"calc"\n\n',
              b"data: [DONE]\n\n"]
    seen = serve(body(stream=True, conversation="c"), broken, streamed=True)
    assert seen["body"] == b"".join(broken) and seen["hints"] == []


def test_the_watch_reads_only_what_can_hold_a_tool_call():
    watch = ReplyWatch()
    watch.feed({"type": "http.response.start", "status": 200, "headers": [(b"Content-Type", b"text/event-stream")]})
    for event in stream():  # content only: nothing parsed, nothing called
        watch.feed({"type": "http.response.body", "body": event, "more_body": True})
    assert watch.streamed and not watch.unread and watch.tools() == []
    watch.feed({"type": "http.response.body", "body": b"", "more_body": False})
    assert watch.done and watch.tools() == []
    several = ReplyWatch()
    several.feed({"type": "http.response.start", "status": 200, "headers": []})
    several.feed({"type": "http.response.body", "body": reply("a", "b", n=2)})
    assert several.tools() == ["a", "b", "a", "b"]  # every choice's (the hint keeps them once)


def test_a_follow_up_waiting_behind_a_head_that_does_not_fit_gives_its_pinned_blocks_back():
    # A follow-up arrived (claimed its kept turn) but waits behind a head that needs room: nothing
    # else frees its pins, so an engine with nothing running would wait for ever.
    keeper, blocks = keeper_with(Strategy.PRESERVE)
    for b in blocks:
        b.ref_cnt -= 1  # the finished turn's own references are gone: only the keeper's pin is left
    keeper.claim("c", "follow-up", list(range(16)), 1.0)
    assert keeper.relieve(0, 2, head_rid="follow-up") == 0  # at the head, it needs its own blocks
    assert all(b.ref_cnt == 1 for b in blocks)
    assert keeper.relieve(1, 1, head_rid="other") == 0  # enough is free already
    assert keeper.relieve(0, 2, head_rid="other") == 1
    assert all(b.ref_cnt == 0 for b in blocks) and keeper.snapshot()["retention_yielded"] == 1
    keeper.scheduled("follow-up", 8)  # later scheduled: nothing left to unpin, its reuse still counted
    assert all(b.ref_cnt == 0 for b in blocks) and keeper.stats.reused_tokens == 8
    assert keeper.relieve(0, 2, head_rid="other") == 0


def test_unclaimed_preserves_give_way_before_waiting_follow_ups():
    keeper, claimed = keeper_with(Strategy.PRESERVE)
    keeper.claim("c", "follow-up", list(range(16)), 1.0)
    kept_blocks = [Block(10 + i) for i in range(3)]
    assert keeper.keep("d", "r2", list(range(12)), 12, kept_blocks, Strategy.PRESERVE, 2.0, 60.0) is not None
    for b in claimed + kept_blocks:
        b.ref_cnt -= 1
    assert keeper.relieve(0, 3, head_rid="other") == 1  # the unclaimed turn's three blocks suffice
    assert "d" not in keeper.kept and all(b.ref_cnt == 1 for b in claimed)
    assert keeper.stats.yielded == 0


class _BlockAllocation:
    """vLLM's KV cache manager as `_allocate_giving_way` reaches it: `allocate_slots` fits a request
    when the pool has its blocks free, and the pool counts the pinned blocks that went back to it."""

    def __init__(self, blocks: list, needed: dict[str, int]) -> None:
        self.kept_blocks, self.needed, self.tries = blocks, needed, []
        self.block_pool = SimpleNamespace(get_num_free_blocks=self.free)

    def free(self) -> int:
        return sum(1 for block in self.kept_blocks if block.ref_cnt == 0)

    def allocate_slots(self, request, num_new_tokens):
        self.tries.append(request.request_id)
        return ["blocks"] if self.needed[request.request_id] <= self.free() else None


def test_a_request_whose_blocks_do_not_fit_unpins_the_follow_ups_waiting_behind_it(steps):
    steps.finish("chat", "turn-1", tool_s=0.001)  # a short tool: Preserve
    kept = steps._keeper.kept["chat"]
    pinned = list(kept.pinned)
    assert kept.strategy is Strategy.PRESERVE and len(pinned) > 1
    for block in pinned:
        block.ref_cnt -= 1  # vLLM freed the finished turn: the keeper's pin is the only reference
    steps._keeper.claim("chat", "follow-up", list(range(2100)), 1.0)  # arrived; waits unscheduled
    assert not steps._keeper.kept  # nothing unclaimed is left to release
    steps.kv_cache_manager = manager = _BlockAllocation(pinned, {"head": len(pinned), "follow-up": 1,
                                                                 "huge": len(pinned) + 1})
    steps._let_kept_give_way()
    follow_up, head, huge = (SimpleNamespace(request_id=rid) for rid in ("follow-up", "head", "huge"))
    assert steps.kv_cache_manager.allocate_slots(follow_up, 16) is None  # its own pins stay its own
    assert all(block.ref_cnt == 1 for block in pinned) and manager.tries == ["follow-up"]
    steps._swapper.snapshot_dirty = False
    assert steps.kv_cache_manager.allocate_slots(head, 16) == ["blocks"]  # tried again once they went
    assert all(block.ref_cnt == 0 for block in pinned)  # back in vLLM's prefix cache, free for the head
    assert steps._keeper.stats.yielded == 1 and steps._swapper.snapshot_dirty
    assert manager.tries == ["follow-up", "head", "head"]
    assert steps.kv_cache_manager.allocate_slots(huge, 16) is None  # nothing left to give: vLLM's answer
    assert manager.tries[-1] == "huge" and manager.tries.count("huge") == 1


@pytest.mark.parametrize("beyond_one_pin,kept_after", [(False, 1), (True, 0)])
def test_kept_preserves_give_way_one_by_one_until_the_allocation_fits(steps, beyond_one_pin, kept_after):
    for conversation, tool_s in (("a", 0.001), ("b", 0.001)):
        steps.finish(conversation, f"{conversation}-1", tool_s=tool_s)
    pins = {c: list(steps._keeper.kept[c].pinned) for c in ("a", "b")}
    for block in pins["a"] + pins["b"]:
        block.ref_cnt -= 1
    needed = len(pins["a"]) + 1 if beyond_one_pin else 1  # more than one pin holds: both must go
    steps.kv_cache_manager = manager = _BlockAllocation(pins["a"] + pins["b"], {"new": needed})
    steps._let_kept_give_way()
    assert steps.kv_cache_manager.allocate_slots(SimpleNamespace(request_id="new"), 16) == ["blocks"]
    assert len(steps._keeper.kept) == kept_after and manager.tries == ["new"] * (3 - kept_after)


# --- replies of the other endpoints, and requests that name no conversation ----------------------

def messages_reply(*calls: str, stop: str = "tool_use") -> bytes:
    content = [{"type": "text", "text": "let me see"}] + [
        {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {}} for i, name in enumerate(calls)]
    return json.dumps({"id": "msg_1", "type": "message", "content": content, "stop_reason": stop}).encode()


def messages_stream(*calls: str, stop: str = "tool_use") -> list[bytes]:
    def event(kind, data):
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    events = [event("message_start", {"message": {"id": "msg_1", "content": []}})]
    for i, name in enumerate(calls):
        events.append(event("content_block_start", {"index": i, "content_block": {
            "type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {}}}))
        events.append(event("content_block_delta", {"index": i, "delta": {
            "type": "input_json_delta", "partial_json": "{\"command\": \"ls\"}"}}))
        events.append(event("content_block_stop", {"index": i}))
    events.append(event("message_delta", {"delta": {"stop_reason": stop}}))
    return events + [event("message_stop", {})]


def responses_reply(*calls: str) -> bytes:
    output = [{"type": "function_call", "name": name, "arguments": "{}", "call_id": f"call_{i}"}
              for i, name in enumerate(calls)] or [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]
    return json.dumps({"id": "resp_1", "object": "response", "status": "completed", "output": output}).encode()


def responses_stream(*calls: str) -> list[bytes]:
    def event(kind, data):
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    events = [event("response.created", {"response": {"id": "resp_1"}})]
    for i, name in enumerate(calls):
        item = {"type": "function_call", "name": name, "arguments": "", "call_id": f"call_{i}"}
        events.append(event("response.output_item.added", {"output_index": i, "item": item}))
        events.append(event("response.function_call_arguments.delta", {"output_index": i, "delta": "{}"}))
        events.append(event("response.output_item.done", {"output_index": i, "item": {**item, "arguments": "{}"}}))
    return events + [event("response.completed", {"response": {"id": "resp_1", "status": "completed"}})]


def with_rid(rid: str = "mars-1", **fields) -> bytes:
    """A body as the prediction middleware hands it on: a `rid` in its marsched object."""
    xargs = {"marsched": json.dumps({"rid": rid, **fields})}
    return json.dumps({"model": "m", "messages": [], "vllm_xargs": xargs}).encode()


@pytest.mark.parametrize("path,messages,streamed", [
    ("/v1/chat/completions", [reply("get_weather")], False),
    ("/v1/chat/completions", stream("get_weather"), True),
    ("/v1/messages", [messages_reply("get_weather")], False),
    ("/v1/messages", messages_stream("get_weather"), True),
    ("/v1/responses", [responses_reply("get_weather")], False),
    ("/v1/responses", responses_stream("get_weather"), True),
])
def test_a_reply_calling_tools_on_every_endpoint_starts_the_pause_of_its_request(path, messages, streamed):
    """No conversation named: the scheduler knows the request's conversation, the API server its rid."""
    seen = serve(with_rid(), messages, streamed=streamed, path=path)
    assert seen["body"] == b"".join(messages)
    assert seen["hints"] == [[f"{CALLED_PREFIX}mars-1\x1fget_weather"]]
    named = serve(with_rid(conversation="c"), messages, streamed=streamed, path=path)
    assert named["hints"] == [[f"{TOOL_PREFIX}c\x1fget_weather"]]  # a named conversation: by its id


@pytest.mark.parametrize("path,messages,streamed", [
    ("/v1/messages", [messages_reply()], False),
    ("/v1/messages", [messages_reply("Bash", stop="max_tokens")], False),  # cut: no call was made
    ("/v1/messages", messages_stream("Bash", stop="max_tokens"), True),
    ("/v1/responses", [responses_reply()], False),
    ("/v1/responses", responses_stream(), True),
    ("/v1/chat/completions", [reply("calc", finish="length")], False),
])
def test_a_reply_calling_no_tool_tells_nothing(path, messages, streamed):
    assert serve(with_rid(), messages, streamed=streamed, path=path)["hints"] == []


def test_called_hints_round_trip_and_bad_ones_are_none():
    assert called_id("mars-1", ["a", "b", "a"]) == f"{CALLED_PREFIX}mars-1\x1fa,b"
    assert read_called("mars-1\x1fa,b") == ("mars-1", ("a", "b"))
    assert called_id("", ["a"]) is None and called_id("r", []) is None
    assert read_called("no separator") is None and read_called("\x1fa") is None and read_called("r\x1f") is None


# --- completions: the server's tool-call parser reads the text -----------------------------------


def completion_reply(text: str, finish: str = "stop") -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion",
                       "choices": [{"index": 0, "text": text, "finish_reason": finish}]}).encode()


def completion_stream(text: str, finish: str = "stop") -> list[bytes]:
    def event(piece, finish_reason=None):
        chunk = {"id": "cmpl-1", "object": "text_completion",
                 "choices": [{"index": 0, "text": piece, "finish_reason": finish_reason}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    return [event(p) for p in pieces[:-1]] + [event(pieces[-1], finish), b"data: [DONE]\n\n"]


def pythonic_reader():
    """The reader `completion_calls` builds, on vLLM's pythonic parser (the test servers' own)."""
    pytest.importorskip("vllm")
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

    from marsched.serve.completion_tools import completion_calls

    serving = SimpleNamespace(parser_cls=SimpleNamespace(tool_parser_cls=PythonicToolParser),
                              renderer=SimpleNamespace(tokenizer=None))
    state = SimpleNamespace(openai_serving_chat=serving)
    reader = completion_calls({"app": SimpleNamespace(state=state)})
    assert reader is not None and completion_calls({"app": SimpleNamespace(state=state)}) is reader  # built once
    return reader


CALL_TEXT = "[get_weather(city='paris'), calc(expression='6*7')]"


@pytest.mark.parametrize("streamed", [False, True])
def test_a_completion_whose_text_the_parser_reads_as_calls_starts_the_pause(streamed):
    read_calls = pythonic_reader()
    messages = completion_stream(CALL_TEXT) if streamed else [completion_reply(CALL_TEXT)]
    seen = serve(with_rid(), messages, streamed=streamed, path="/v1/completions", read_calls=read_calls)
    assert seen["body"] == b"".join(messages)
    assert seen["hints"] == [[f"{CALLED_PREFIX}mars-1\x1fget_weather,calc"]]


@pytest.mark.parametrize("case", ["no call in the text", "cut at length", "stream cut at length", "no parser"])
def test_a_completion_calls_nothing_without_a_parser_or_a_call_it_reads(case):
    read_calls, messages, streamed = pythonic_reader(), [completion_reply(CALL_TEXT)], False
    if case == "no call in the text":
        messages = [completion_reply("sunny and 20 degrees")]
    elif case == "cut at length":
        messages = [completion_reply(CALL_TEXT, finish="length")]
    elif case == "stream cut at length":
        messages, streamed = completion_stream(CALL_TEXT, finish="length"), True
    elif case == "no parser":
        read_calls = None
    seen = serve(with_rid(), messages, streamed=streamed, path="/v1/completions", read_calls=read_calls)
    assert seen["hints"] == [] and seen["body"] == b"".join(messages)


def test_no_reader_without_a_tool_parser_or_a_chat_serving_object():
    from marsched.serve.completion_tools import completion_calls

    none = SimpleNamespace(openai_serving_chat=SimpleNamespace(parser_cls=None))
    assert completion_calls({"app": SimpleNamespace(state=none)}) is None and none.marsched_completion_tools is None
    starting = SimpleNamespace()  # vLLM has not set up its serving objects yet: asked again later
    assert completion_calls({"app": SimpleNamespace(state=starting)}) is None
    assert not hasattr(starting, "marsched_completion_tools")


def test_names_in_takes_only_calls_the_parser_says_were_made():
    from marsched.serve.completion_tools import names_in

    call = SimpleNamespace(function=SimpleNamespace(name="calc"))
    made = SimpleNamespace(extract_tool_calls=lambda text, request: SimpleNamespace(tools_called=True, tool_calls=[call]))
    half = SimpleNamespace(extract_tool_calls=lambda text, request: SimpleNamespace(tools_called=False, tool_calls=[call]))

    def choke(text, request):
        raise ValueError(text)

    assert names_in(made, "x", None) == ["calc"]
    assert names_in(half, "x", None) == [] and names_in(SimpleNamespace(extract_tool_calls=choke), "x", None) == []
