"""Data-parallel affinity without an engine: the placement rules, the middleware that sets vLLM's
`X-data-parallel-rank` from a turn's conversation, and how releases and stop-string ends reach
the ranks through vLLM's own data-parallel client (`DPLBAsyncMPClient`, its real abort code,
with the socket replaced). Live, on `--data-parallel-size 2`: test_serve_data_parallel.py."""

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
