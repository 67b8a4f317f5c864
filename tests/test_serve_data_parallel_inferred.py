"""Data-parallel affinity for conversations that name no id, live on `--data-parallel-size 2`: the
unmodified `openai` SDK, no marsched field, no conversation id, no header of ours.

Each follow-up must reach the rank that kept its previous turn's KV (the front end recognises it
from its messages, `serve/history.py`, by the engine core's rule, `FollowUps`), and find that KV
kept: >= 95% of follow-ups are retention hits by `/metrics`. Every conversation starts with the same
system prompt, and a conversation built to look like another's (the same system prompt, a first
message that starts alike) is not taken for it, in the front end or in the engine core.
"""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import WEATHER, Server, openai_client  # noqa: E402
from test_serve_unmodified_clients import HIT_SHARE, SYSTEM, counters  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CONVERSATIONS, TOOL_TURNS = 6, 2
RANK_TRACES = ("trace.jsonl", "trace.rank1.jsonl")


@pytest.fixture(scope="module")
def server(dp_server):
    return dp_server


def arrivals(server: Server) -> dict[str, dict]:
    """Every `arrive` event with a rid, by its rid, with the rank whose trace holds it."""
    from marsched.metrics.trace import read_trace

    found = {}
    for rank, name in enumerate(RANK_TRACES):
        trace = server.trace.with_name(name)
        for event in read_trace(trace) if trace.exists() else ():
            if event["event"] == "arrive" and event.get("rid"):
                found[event["rid"]] = {**event, "rank": rank}
    return found


def turn(client, server: Server, messages: list, tools: bool, **options) -> tuple[str, dict]:
    """One turn: the rid the front end gave it, and the assistant message as the client appends it."""
    request = dict(model=server.model, messages=messages, temperature=0, max_tokens=40 if tools else 4, **options)
    if tools:
        request.update(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    raw = client.chat.completions.with_raw_response.create(**request)
    message = raw.parse().choices[0].message
    assert not tools or message.tool_calls, message
    return raw.headers["x-marsched-request-id"], message.model_dump(exclude_none=True)


def conversation(client, server: Server, first: str) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    rids = []
    for index in range(TOOL_TURNS):
        rid, message = turn(client, server, messages, tools=True)
        rids.append(rid)
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                               "content": f"rain, {12 + index} degrees"}]
        time.sleep(0.2)  # the client's tool
    rids.append(turn(client, server, messages, tools=False)[0])
    return rids


def wait_for_arrivals(server: Server, rids: list[str], timeout_s: float = 30.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = arrivals(server)
        if all(rid in found for rid in rids) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_unnamed_follow_ups_reach_the_rank_that_kept_their_kv(server):
    run = uuid.uuid4().hex[:8]
    before, affinity_before = counters(server), server.state()["affinity"]
    with openai_client(server) as client:
        conversations = [conversation(client, server, f"{run}-{index} what is the weather in paris today")
                         for index in range(CONVERSATIONS)]
    found = wait_for_arrivals(server, [rid for rids in conversations for rid in rids])
    on = []
    for rids in conversations:
        events = [found[rid] for rid in rids]
        assert len({e["rank"] for e in events}) == 1, events  # every turn on one rank
        assert len({e["program"] for e in events}) == 1 and {e["identity"] for e in events} == {"inferred"}, events
        on.append(events[0]["rank"])
    assert set(on) == {0, 1}, f"every conversation went to one rank: {on}"
    follow_ups = CONVERSATIONS * TOOL_TURNS
    after = counters(server)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert delta["marsched_retention_hits_total"] >= HIT_SHARE * follow_ups, delta
    assert delta["marsched_follow_ups_matched_total"] == follow_ups, delta
    affinity = server.state()["affinity"]
    assert affinity["inferred_started"] - affinity_before["inferred_started"] == CONVERSATIONS, affinity
    assert affinity["inferred_matched"] - affinity_before["inferred_matched"] == follow_ups, affinity
    print({"follow_ups": follow_ups, "hits": delta["marsched_retention_hits_total"],
           "misses": delta["marsched_retention_misses_total"], "ranks": on})

    # Built to tempt, while a conversation's first turn is the one remembered: the same system prompt,
    # and a first message that is that conversation's whole first message and more. In the engine, the
    # difference lies in the prompt's last, partial block (the tail that the hashes leave out).
    first = f"{run}-tempted what is the weather in paris today"
    with openai_client(server) as client:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
        tempted, message = turn(client, server, messages, tools=True)
        rank = wait_for_arrivals(server, [tempted])[tempted]["rank"]
        before, affinity_before = counters(server), server.state()["affinity"]
        # vLLM's own header puts the new conversation on the tempted one's rank, where the engine core
        # remembers the tempted turn (placement alone might put it on the other).
        stranger_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first + " and in oslo"}]
        stranger, stranger_message = turn(client, server, stranger_messages, tools=True,
                                          extra_headers={"X-data-parallel-rank": str(rank)})
        found = wait_for_arrivals(server, [stranger])
        after, affinity = counters(server), server.state()["affinity"]
        assert found[stranger]["rank"] == rank
        assert found[stranger]["program"] != found[tempted]["program"], (found[stranger], found[tempted])
        assert after["marsched_follow_ups_matched_total"] == before["marsched_follow_ups_matched_total"]
        assert affinity["inferred_started"] - affinity_before["inferred_started"] == 1, affinity
        assert affinity["inferred_matched"] == affinity_before["inferred_matched"], affinity
        # The tempted conversation goes on, on its rank, its KV kept.
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "rain"}]
        follow_up, _ = turn(client, server, messages, tools=False)
    found = wait_for_arrivals(server, [follow_up])
    assert found[follow_up]["program"] == found[tempted]["program"], (found[follow_up], found[tempted])
    assert found[follow_up]["rank"] == found[tempted]["rank"]
    final = counters(server)
    assert final["marsched_retention_hits_total"] == after["marsched_retention_hits_total"] + 1
    # The stranger ends too, as a client would, so that nothing is left kept when the server stops
    # (each rank's trace is audited then: a kept turn's host blocks would count as leaked).
    stranger_messages += [stranger_message, {"role": "tool", "content": "snow",
                                             "tool_call_id": stranger_message["tool_calls"][0]["id"]}]
    with openai_client(server) as client:
        turn(client, server, stranger_messages, tools=False, extra_headers={"X-data-parallel-rank": str(rank)})
