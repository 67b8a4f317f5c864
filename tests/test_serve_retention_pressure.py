"""Kept conversations when KV memory binds: a live `marsched serve` with 48 blocks of 32 tokens
(the session's tools server, `servers.TOOLS`; its server-side tools are not used here).

Between a turn and its follow-up, other requests pass through the cache. A Preserve-kept
turn survives them (its blocks are pinned) and its follow-up recomputes nothing it had; a
discarded turn's blocks, back in vLLM's prefix cache like stock vLLM's, are evicted by the
traffic and its follow-up recomputes them. When kept conversations hold so much that the
head of the queue cannot start, they give way inside vLLM's block allocation, the newest
program's first, until it fits.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import Server  # noqa: E402
from test_serve_conversations import marsched, tool_turn, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WORDS = "the quick brown fox jumps over the lazy dog and the answer is forty two".split()


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def traffic(client, server: Server, tag: str, requests: int, words: int = 300) -> None:
    """Other users' requests, each a different long prompt: they take every free block in turn."""
    for index in range(requests):
        text = " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(words))
        client.completions.create(model=server.model, prompt=f"{tag} {index} {text}", max_tokens=4, temperature=0)


def reused_by_follow_up(client, server: Server, messages: list, conversation: str) -> tuple[int, list[int]]:
    before = server.state()["scheduler"]["retention_reused_tokens"]
    response = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=8,
        extra_body={"return_token_ids": True, **marsched(conversation=conversation, retain=False)})
    time.sleep(0.3)
    after = server.state()["scheduler"]["retention_reused_tokens"]
    return after - before, list(response.choices[0].model_extra["token_ids"])


def test_preserve_survives_the_traffic_that_evicts_a_discarded_turn(server, client):
    kept, _ = tool_turn(client, server, "keep-me", strategy="preserve")
    dropped, _ = tool_turn(client, server, "drop-me", strategy="discard")
    state = wait_for(server, lambda s: s["retained_preserve"] == 1, "the preserve")
    pinned = state["retained_device_blocks"]
    assert pinned >= 3
    traffic(client, server, "evict", requests=6)  # ~60 blocks' worth through a 48-block cache
    assert server.state()["scheduler"]["retained_device_blocks"] == pinned  # untouched by the traffic

    misses = server.state()["scheduler"]["retention_misses"]
    reused, _ = reused_by_follow_up(client, server, dropped, "drop-me")
    assert server.state()["scheduler"]["retention_misses"] == misses + 1
    reused_kept, tokens = reused_by_follow_up(client, server, kept, "keep-me")
    assert reused_kept >= pinned * 32 and reused == 0
    fresh = client.chat.completions.create(model=server.model, messages=kept, temperature=0, max_tokens=8,
                                           extra_body={"return_token_ids": True, "cache_salt": "fresh"})
    assert tokens == list(fresh.choices[0].model_extra["token_ids"])


def test_kept_conversations_give_way_when_the_head_of_the_queue_does_not_fit(server, client):
    before = server.state()["scheduler"]
    # Four long first turns kept on the device: 4 x ~10 of the 48 blocks.
    for index in range(4):
        text = " ".join(WORDS[(index + i) % len(WORDS)] for i in range(300))
        response = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"user {index} {text}"}], temperature=0,
            max_tokens=4, extra_body=marsched(conversation=f"long-{index}", strategy="preserve"))
        assert response.choices[0].finish_reason in ("stop", "length")
    state = wait_for(server, lambda s: s["retained_preserve"] == 4, "four preserves")
    assert state["device_free_blocks"] < 14
    # A new long request (~14 blocks) needs more than what is free: the newest kept turns are let go for it.
    traffic(client, server, "head", requests=1, words=420)
    after = wait_for(server, lambda s: s["retained_preserve"] < 4, "the release for room")
    assert after["retention_released"] > before["retention_released"]
    assert after["retained_preserve"] >= 2  # only as many as the head needed
    for index in range(4):
        server.client.delete(f"{server.url}/marsched/conversations/long-{index}")
    settled = wait_for(server, lambda s: s["retained_preserve"] == 0 and s["device_free_blocks"]
                       == s["device_total_blocks"], "the cleanup")
    assert settled["retained_device_blocks"] == 0
