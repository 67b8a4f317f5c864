"""Data-parallel affinity without an engine: the placement rules, the middleware that sets vLLM's
`X-data-parallel-rank` from a turn's conversation, and how releases and stop-string ends reach
the ranks through vLLM's own data-parallel client (`DPLBAsyncMPClient`, its real abort code,
with the socket replaced), and the history a follow-up that names no conversation is routed by. Live, on
`--data-parallel-size 2`: test_serve_data_parallel.py and test_serve_data_parallel_inferred.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from marsched.serve.affinity import (ConversationRouter, DataParallelAffinityMiddleware, Turn, placement_from_env,
                                     turn_of)
from marsched.policy.placement import (Placement, RankLoad, hashed_rank, least_loaded_scores, lowest,
                                      mars_scores)


def body(**meta) -> bytes:
    return json.dumps({"prompt": "hi", "vllm_xargs": {"marsched": json.dumps(meta)}}).encode()


# --- the rules ------------------------------------------------------------------------------------


def test_mars_places_by_memory_time_and_counts_placements_since_the_look():
    loads = [RankLoad(memory_time=900.0, tracked=3), RankLoad(memory_time=300.0, tracked=3)]
    assert lowest(mars_scores(loads, [0, 0]), 0) == 1
    # mean key 200 a request: two placed on rank 1 since the look make it 700, still the lower
    assert mars_scores(loads, [0, 2]) == [900.0, 700.0]
    assert lowest(mars_scores(loads, [0, 4]), 0) == 0  # 1100 > 900


def test_mars_and_vllms_rule_disagree_where_the_queue_is_short_but_the_memory_time_is_long():
    # rank 0: one long request; rank 1: three short ones
    loads = [RankLoad(memory_time=5000.0, tracked=1, running=1), RankLoad(memory_time=600.0, tracked=3, running=3)]
    assert lowest(mars_scores(loads, [0, 0]), 0) == 1
    assert lowest(least_loaded_scores(loads, [0, 0], [0, 0]), 0) == 0


def test_least_loaded_is_vllms_score():
    loads = [RankLoad(waiting=2, running=1, kv_usage=0.75), RankLoad(waiting=0, running=4, kv_usage=0.9)]
    # max(in flight, waiting + running) + waiting * 6 * max(0, usage - 0.5)
    assert least_loaded_scores(loads, [0, 0], [5, 0]) == [5 + 2 * 6 * 0.25, 4.0]
    assert least_loaded_scores(loads, [1, 0], [0, 0]) == [3 + 1 + 3 * 6 * 0.25, 4.0]  # one placed: one waiting


def test_ties_rotate_and_the_hash_is_stable():
    assert [lowest([0.0, 0.0, 0.0], start) for start in range(4)] == [0, 1, 2, 0]
    assert lowest([1.0, 0.0, 0.0], 2) == 2 and lowest([0.0, 1.0, 0.0], 1) == 2
    assert hashed_rank("chat-42", 4) == hashed_rank("chat-42", 4) < 4
    assert len({hashed_rank(f"c{i}", 2) for i in range(20)}) == 2


def test_placement_names_and_bad_values():
    assert placement_from_env({}) is Placement.LEAST_LOADED
    assert placement_from_env({"MARSCHED_DP_PLACEMENT": "mars"}) is Placement.MARS
    with pytest.raises(ValueError, match="MARSCHED_DP_PLACEMENT 'nearest': give one of mars, least-loaded"):
        placement_from_env({"MARSCHED_DP_PLACEMENT": "nearest"})


def test_turn_of_reads_the_conversation_and_passes_anything_else():
    assert turn_of(body(conversation="c1")) == Turn("c1", last=False)
    assert turn_of(body(conversation="c1", retain=False)) == Turn("c1", last=True)
    for raw in (b"not json", b"[1]", body(), body(conversation=7), body(conversation="a/b"),
                json.dumps({"vllm_xargs": {"marsched": "{bad"}}).encode(), json.dumps({"vllm_xargs": 3}).encode()):
        assert turn_of(raw) is None, raw  # vLLM's validator answers the malformed ones


# --- the router -----------------------------------------------------------------------------------


def test_a_conversation_keeps_its_rank_and_a_new_one_goes_to_the_lighter_rank():
    looks = []

    async def look():
        looks.append(1)
        return [RankLoad(memory_time=100.0, tracked=1), RankLoad(memory_time=0.0)]

    async def run():
        router = ConversationRouter(2, Placement.MARS, look)
        first = await router.rank_for(Turn("a", False), None)
        again = await router.rank_for(Turn("a", False), None)
        given = await router.rank_for(Turn("b", False), 0)  # the client's header wins for a new one
        kept = await router.rank_for(Turn("b", False), 1)  # ... and is kept after
        return router, first, again, given, kept

    router, first, again, given, kept = asyncio.run(run())
    assert (first, again, given, kept) == (1, 1, 0, 0)
    assert len(looks) == 1  # looked once: the next placement is within LOOK_EVERY_S
    assert router.state()["conversations_by_rank"] == [1, 1] and router.state()["placed_by_rank"] == [0, 1]
    router.forget("a")
    assert "a" not in router.rank_of


def test_an_engine_that_does_not_answer_leaves_placement_to_the_counts():
    async def look():
        raise TimeoutError

    async def run():
        router = ConversationRouter(2, Placement.MARS, look)
        return [await router.rank_for(Turn(f"c{i}", False), None) for i in range(4)]

    assert asyncio.run(run()) == [0, 1, 0, 1]


# --- the middleware -------------------------------------------------------------------------------


def serve(middleware, raw: bytes, headers=(), path="/v1/chat/completions"):
    seen = {}

    async def app(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        seen["body"] = (await receive())["body"]

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers), "app": middleware.fake_app}
    asyncio.run(middleware(app)(scope, receive, send))
    return seen


class Middleware:
    """DataParallelAffinityMiddleware over an app whose engine client has `ranks` engine cores."""

    def __init__(self, ranks: int, clients: int = 1, placement: str = "mars") -> None:
        core = SimpleNamespace(core_engines=[bytes([r, 0]) for r in range(ranks)], client_count=clients)
        self.fake_app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=core)))
        self.placement = placement

    def __call__(self, app):
        import os

        os.environ["MARSCHED_DP_PLACEMENT"] = self.placement
        return DataParallelAffinityMiddleware(app)

    @property
    def router(self):
        return self.fake_app.state.marsched_affinity


@pytest.fixture(autouse=True)
def placement_env():
    """`Middleware` sets $MARSCHED_DP_PLACEMENT (the router reads it at its first request): put it back."""
    import os

    before = os.environ.pop("MARSCHED_DP_PLACEMENT", None)
    yield
    os.environ.pop("MARSCHED_DP_PLACEMENT", None)
    if before is not None:
        os.environ["MARSCHED_DP_PLACEMENT"] = before


def test_every_turn_of_a_conversation_gets_its_rank_and_the_body_is_unchanged(monkeypatch):
    monkeypatch.setattr("marsched.serve.affinity.LOOK_EVERY_S", 1e9)  # no engine to look at
    middleware = Middleware(2)
    ranks = {}
    for turn in range(3):
        for name in ("c0", "c1", "c2", "c3"):
            raw = body(conversation=name, retain=turn < 2)
            seen = serve(middleware, raw, headers=[(b"x-data-parallel-rank", b"0"), (b"accept", b"*/*")]
                         if name == "c3" and turn == 0 else [])
            assert seen["body"] == raw
            ranks.setdefault(name, set()).add(seen["headers"][b"x-data-parallel-rank"])
    assert ranks == {"c0": {b"0"}, "c1": {b"1"}, "c2": {b"0"}, "c3": {b"0"}}  # c3: the client's, then kept
    assert middleware.router.rank_of == {}  # the last turns (retain: false) forgot them


def test_requests_without_a_conversation_and_one_rank_pass_as_they_came():
    two = Middleware(2)
    assert b"x-data-parallel-rank" not in serve(two, b'{"prompt": "hi"}')["headers"]
    assert b"x-data-parallel-rank" not in serve(two, body(conversation="c"), path="/v1/models")["headers"]
    one = Middleware(1)
    assert serve(one, body(conversation="c"))["headers"] == {}
    assert one.router is None
    off = Middleware(2, placement="off")
    assert serve(off, body(conversation="c"))["headers"] == {}


def test_a_bad_placement_in_the_environment_falls_back_to_vllms_rule(caplog):
    bad = Middleware(2, placement="nearest")
    assert b"x-data-parallel-rank" in serve(bad, body(conversation="c"))["headers"]
    assert bad.router.placement is Placement.LEAST_LOADED and "MARSCHED_DP_PLACEMENT 'nearest'" in caplog.text


def test_several_api_servers_hash_the_conversation():
    middleware = Middleware(2, clients=2)
    seen = serve(middleware, body(conversation="chat-42"))
    assert middleware.router.placement is Placement.HASH
    assert seen["headers"][b"x-data-parallel-rank"] == str(hashed_rank("chat-42", 2)).encode()


# --- releases and stop-string ends through vLLM's data-parallel client ------------------------------


def dp_client(in_flight: dict[str, int]):
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    core = object.__new__(DPLBAsyncMPClient)  # its real abort code; the socket below records
    core.core_engines = [b"\x00\x00", b"\x01\x00"]
    core.reqs_in_flight = {rid: core.core_engines[rank] for rid, rank in in_flight.items()}
    core.resources = SimpleNamespace(engine_dead=False)
    core.encoder = SimpleNamespace(encode=lambda request: (request,))
    sent: list[tuple[int, list[str]]] = []

    async def send_message(message, engine):
        sent.append((core.core_engines.index(engine), list(message[1])))

    core._send_input_message = send_message
    return core, sent


def test_vllms_dp_client_drops_our_marks_and_a_release_reaches_every_rank():
    pytest.importorskip("vllm")
    from marsched.vllm.retention import send_release

    core, sent = dp_client({"r1": 1})
    asyncio.run(core.abort_requests_async(["marsched-release:chat-1"]))
    assert sent == []  # what vLLM does with an id it did not place
    asyncio.run(send_release(SimpleNamespace(engine_core=core), "chat-1"))
    assert sent == [(0, ["marsched-release:chat-1"]), (1, ["marsched-release:chat-1"])]


def test_a_stop_string_end_goes_with_its_request_to_its_rank():
    pytest.importorskip("vllm")
    from marsched.vllm.abort_routing import route_marks_with_their_requests
    from marsched.vllm.stop_strings import STOPPED_PREFIX

    core, sent = dp_client({"r0": 0, "r1": 1, "r2": 1})
    assert route_marks_with_their_requests(core, STOPPED_PREFIX)
    assert not route_marks_with_their_requests(core, STOPPED_PREFIX)  # once
    asyncio.run(core.abort_requests_async(["r1", "r0", STOPPED_PREFIX + "r1", STOPPED_PREFIX + "r0", "gone"]))
    assert sorted(sent) == [(0, ["r0", STOPPED_PREFIX + "r0"]), (1, ["r1", STOPPED_PREFIX + "r1"])]
    sent.clear()
    asyncio.run(core.abort_requests_async(["r2"]))  # a client's abort: vLLM's own path
    assert sent == [(1, ["r2"])]


def test_marking_stop_string_ends_also_routes_them_under_data_parallelism():
    pytest.importorskip("vllm")
    from marsched.vllm.stop_strings import STOPPED_PREFIX, mark_stop_string_ends

    core, sent = dp_client({"r1": 1})
    output = SimpleNamespace(reqs_to_abort=["r1"])
    engine = SimpleNamespace(output_processor=SimpleNamespace(process_outputs=lambda *a: output), engine_core=core)
    assert mark_stop_string_ends(engine)
    ended = engine.output_processor.process_outputs()
    asyncio.run(core.abort_requests_async(ended.reqs_to_abort))
    assert sent == [(1, ["r1", STOPPED_PREFIX + "r1"])]


def test_a_ranks_load_is_read_from_its_published_state_and_junk_reads_as_zero():
    state = {"memory_time_in_flight": 1234.5, "tracked": 7, "waiting": 3, "running": 4, "device_usage": 0.625}
    assert RankLoad.from_state(state) == RankLoad(memory_time=1234.5, tracked=7, waiting=3, running=4, kv_usage=0.625)
    junk = {"memory_time_in_flight": "lots", "tracked": True, "waiting": None, "running": [1], "device_usage": {}}
    assert RankLoad.from_state(junk) == RankLoad() == RankLoad.from_state({})
    assert RankLoad.from_state({"tracked": 2.0, "waiting": 1}) == RankLoad(tracked=2, waiting=1)


# --- conversations that name no id: recognised from their history (`history.py`) -------------------


def test_history_hashes_what_a_follow_up_sends_again():
    from marsched.serve.history import CHARS_PER_BLOCK, TOKENS_PER_BLOCK, chain, history_of

    system = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
    chat = history_of("/v1/chat/completions", {"messages": [system, user]})
    assert chat.size == 2 and chat.hashes == chain([b'{"content":"be brief","role":"system"}',
                                                     b'{"content":[{"text":"hi","type":"text"}],"role":"user"}'])
    moved = {"role": "user", "content": [{"type": "text", "text": "hi"}]}  # the breakpoint moved on
    assert history_of("/v1/chat/completions", {"messages": [system, moved]}).hashes == chat.hashes
    messages = history_of("/v1/messages", {"system": "be brief", "messages": [moved]})
    assert messages.size == 2 and messages.hashes[1] != chat.hashes[1]  # `system` is its own unit
    text = "x" * (2 * CHARS_PER_BLOCK + 5)
    completion = history_of("/v1/completions", {"prompt": text})
    assert (completion.size, len(completion.hashes), completion.tail) == (len(text), 2, "xxxxx")
    ids = history_of("/v1/completions", {"prompt": list(range(TOKENS_PER_BLOCK + 1))})
    assert (ids.size, len(ids.hashes), ids.tail) == (TOKENS_PER_BLOCK + 1, 1, [TOKENS_PER_BLOCK])
    for path, body in [("/v1/chat/completions", {"messages": [system]}), ("/v1/chat/completions", {"messages": []}),
                       ("/v1/completions", {"prompt": "short"}), ("/v1/completions", {"prompt": [text, text]}),
                       ("/v1/completions", {"prompt": [True] * 99}), ("/v1/responses", {"input": text}),
                       ("/v1/chat/completions", ["not", "an", "object"])]:
        assert history_of(path, body) is None, (path, body)


def answering(status: int = 200, streamed: bool = False):
    """An app that records the rank header it got and answers in one body message (or two)."""
    seen = []

    async def app(scope, receive, send):
        seen.append(dict(scope["headers"]).get(b"x-data-parallel-rank"))
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": []})
        if streamed:
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app, seen


def ask(middleware, body: dict, app, path="/v1/chat/completions") -> None:
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": middleware.fake_app}
    asyncio.run(middleware(app)(scope, receive, send))


SYSTEM_MESSAGE = {"role": "system", "content": "you are a helpful agent " * 6}


def tool_round(messages: list, turn: int) -> list:
    call = {"role": "assistant", "tool_calls": [{"id": f"call-{turn}", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": "{}"}}]}
    return messages + [call, {"role": "tool", "tool_call_id": f"call-{turn}", "content": f"sunny, {turn}"}]


def test_an_inferred_conversation_keeps_its_rank_and_one_with_the_same_system_prompt_is_not_matched(monkeypatch):
    monkeypatch.setattr("marsched.serve.affinity.LOOK_EVERY_S", 1e9)  # no engine to look at
    middleware = Middleware(2)
    app, seen = answering()
    conversations = {name: [SYSTEM_MESSAGE, {"role": "user", "content": f"{name}: the weather in paris?"}]
                     for name in ("a", "b", "c", "d")}
    ranks: dict[str, list] = {}
    for turn in range(3):
        for name, messages in conversations.items():
            ask(middleware, {"messages": messages}, app, path="/v1/messages" if name == "d" else "/v1/chat/completions")
            ranks.setdefault(name, []).append(seen[-1])
            conversations[name] = tool_round(messages, turn)
    assert {name: set(r) for name, r in ranks.items()} == {"a": {b"0"}, "b": {b"1"}, "c": {b"0"}, "d": {b"1"}}
    router = middleware.router
    assert (router.follow.matched, router.state()["inferred_started"]) == (8, 4)
    # Built to tempt: the same system prompt and a first message that starts alike, longer than a's
    # first prompt; a's turns are remembered, so only its own history may match them.
    stranger = [SYSTEM_MESSAGE, {"role": "user", "content": "a: the weather in paris?"[:-1]},
                {"role": "assistant", "content": "which paris?"}, {"role": "user", "content": "france"}]
    ask(middleware, {"messages": stranger}, app)
    assert (router.follow.matched, router.state()["inferred_started"]) == (8, 5)
    retried = conversations["a"][:-2]  # a's last turn sent again (a retry): not its follow-up
    ask(middleware, {"messages": retried}, app)
    assert (router.follow.matched, router.state()["inferred_started"]) == (8, 6)


def test_an_inferred_turn_is_remembered_only_when_answered_and_forgotten_with_its_conversation(monkeypatch):
    monkeypatch.setattr("marsched.serve.affinity.LOOK_EVERY_S", 1e9)
    middleware = Middleware(2)
    first = [SYSTEM_MESSAGE, {"role": "user", "content": "hello"}]
    failing, _ = answering(status=400)
    ask(middleware, {"messages": first}, failing)
    streamed, seen = answering(streamed=True)
    ask(middleware, {"messages": tool_round(first, 0)}, streamed)  # the failed turn left nothing to continue
    router = middleware.router
    assert router.follow.matched == 0 and len(router.follow) == 1
    ask(middleware, {"messages": tool_round(tool_round(first, 0), 1)}, streamed)
    assert router.follow.matched == 1 and seen[-1] == seen[-2]
    assert list(router.rank_of) == ["inferred/2"]  # the unanswered one is forgotten
    router.follow.window_s = 0.0  # the engine core ends the conversation after the same window
    prompt = "the story so far: " + "and then " * 60
    ask(middleware, {"prompt": prompt}, streamed, path="/v1/completions")
    assert list(router.rank_of) == ["inferred/3"] and len(router.follow) == 1


def test_a_completions_follow_up_continues_the_prompt_and_its_tail_is_compared(monkeypatch):
    from marsched.serve.history import CHARS_PER_BLOCK

    monkeypatch.setattr("marsched.serve.affinity.LOOK_EVERY_S", 1e9)
    middleware = Middleware(2)
    app, seen = answering()
    shared = "s" * CHARS_PER_BLOCK  # one full block every prompt has; the rest is in the tail
    ask(middleware, {"prompt": shared + "question one"}, app, path="/v1/completions")
    ask(middleware, {"prompt": shared + "question two, longer than the first"}, app, path="/v1/completions")
    assert middleware.router.follow.matched == 0 and seen == [b"0", b"1"]
    ask(middleware, {"prompt": shared + "question one" + " a reply" + "<tool> 42"}, app, path="/v1/completions")
    assert middleware.router.follow.matched == 1 and seen[-1] == b"0"
