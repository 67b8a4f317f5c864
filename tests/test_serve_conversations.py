"""Client-side tool calls through a live `marsched serve` (the session's chat server, `servers.CHAT`),
driven by the official `openai` client.

A conversation turn ends with a tool call (a named `tool_choice`: the random-weight model
then writes a valid call under vLLM's structured outputs); the server keeps the turn's KV
as the strategy says (forced per request here, or chosen by the policy from `tool_s`) until
the follow-up with the tool's result arrives. Checked against the server's own state
(`/marsched/state`) and against the same follow-up computed from scratch (another
`cache_salt`, so nothing is reused): the tokens must be the same. A follow-up that never
comes is freed at the time limit, or at once by `DELETE /marsched/conversations/ID`.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import CHAT_RETENTION_LIMIT_S, WEATHER, Server, marsched, openai_client  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LIMIT_S = CHAT_RETENTION_LIMIT_S  # the chat server's retention limit
QUESTION = " ".join(["search the web for the weather in paris today and call the calculator api"] * 6)


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def scheduler(server: Server) -> dict:
    return server.state()["scheduler"]


def wait_for(server: Server, check, what: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = scheduler(server)
        if check(state):
            return state
        assert time.monotonic() < deadline, f"{what} never happened: {state}"
        time.sleep(0.1)


def tool_turn(client, server: Server, conversation: str, **meta) -> tuple[list, object]:
    messages = [{"role": "user", "content": f"{conversation} {QUESTION}"}]
    response = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=marsched(conversation=conversation, **meta))
    message = response.choices[0].message
    assert message.tool_calls, f"the model did not call the tool: {response}"
    assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("paris", "oslo")
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny and 20 degrees"})
    return messages, response


def follow_up(client, server: Server, messages: list, extra: dict) -> tuple[list[int], str]:
    response = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=12,
        extra_body={"return_token_ids": True, **extra})
    choice = response.choices[0]
    return list(getattr(choice, "token_ids", None) or choice.model_extra["token_ids"]), choice.message.content


@pytest.mark.parametrize("strategy", ["preserve", "swap", "discard"])
def test_follow_up_reuses_the_kept_turn_and_gets_the_same_tokens(server, client, strategy):
    conversation = f"chat-{strategy}"
    before = scheduler(server)
    messages, _ = tool_turn(client, server, conversation, strategy=strategy, tool_s=2.0)
    if strategy == "preserve":
        kept = wait_for(server, lambda s: s["retained_preserve"] == before["retained_preserve"] + 1, "a preserve")
        assert kept["retained_device_blocks"] > 0
        assert kept["device_free_blocks"] < kept["device_total_blocks"]
    elif strategy == "swap":
        kept = wait_for(server, lambda s: s["retained_swap"] == 1 and s["retained_host_tokens"] > 0, "the copy")
        assert kept["retained_device_blocks"] == 0
        assert server.state()["host_bytes"] > 0
    else:
        kept = scheduler(server)
        assert kept["retained_preserve"] == kept["retained_swap"] == 0

    loaded = server.state()["swap_stats"]["in_blocks"]
    reused, text = follow_up(client, server, messages, marsched(conversation=conversation, retain=False))
    after = scheduler(server)
    if strategy == "swap":  # the device copy was let go: the context came back from the host
        assert server.state()["swap_stats"]["in_blocks"] - loaded >= 2
    fresh, fresh_text = follow_up(client, server, messages, {"cache_salt": f"fresh-{strategy}"})
    assert reused == fresh and text == fresh_text  # the kept KV is the context's KV
    if strategy == "discard":
        assert after["retention_misses"] == before["retention_misses"] + 1
        assert after["retention_hits"] == before["retention_hits"]
    else:
        assert after["retention_hits"] == before["retention_hits"] + 1
        # The whole first turn's prompt (several blocks) was not recomputed.
        assert after["retention_reused_tokens"] - before["retention_reused_tokens"] >= 64
    settled = wait_for(server, lambda s: s["retained_preserve"] == s["retained_swap"] == 0
                       and s["device_free_blocks"] == s["device_total_blocks"], "the release")
    assert settled["retained_device_blocks"] == 0 and server.state()["host_bytes"] == 0


def test_a_turn_that_a_stop_string_ends_keeps_its_kv(server, client):
    """vLLM ends a stop string's request through its abort path; the turn still finished, so it
    is kept (`marsched.vllm.stop_strings`), and the trace says finished, not aborted."""
    messages = [{"role": "user", "content": f"stop-string {QUESTION}"}]
    free = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=16,
                                          extra_body={"cache_salt": "stop-string-probe"})
    text = free.choices[0].message.content
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    assert stop.strip() and len(text) > 8, f"the model wrote too little to stop on: {text!r}"
    before = scheduler(server)
    stopped = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=16, stop=[stop],
        extra_body=marsched(conversation="chat-stop-string", strategy="preserve", rid="stop-string-turn"))
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == text[:text.index(stop)]
    wait_for(server, lambda s: s["retained_preserve"] == before["retained_preserve"] + 1, "the stopped turn kept")
    response = server.client.delete(server.url + "/marsched/conversations/chat-stop-string")
    assert response.status_code == 202
    wait_for(server, lambda s: s["retained_preserve"] == before["retained_preserve"], "the release")
    from marsched.metrics.trace import read_trace

    finishes = [e for e in read_trace(server.trace) if e["event"] == "finish" and e["rid"] == "stop-string-turn"]
    assert [e["status"] for e in finishes] == ["finished"]


def test_a_conversation_of_several_tool_turns_reuses_every_turn(server, client):
    before = scheduler(server)
    messages = [{"role": "user", "content": f"chat-multi {QUESTION}"}]
    for turn in range(3):  # the policy chooses each turn's strategy (tool_s alternates short and long)
        response = client.chat.completions.create(
            model=server.model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_body=marsched(conversation="chat-multi", tool_s=[0.0, 30.0, 0.0][turn]))
        message = response.choices[0].message
        assert message.tool_calls, response
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"result {turn}"})
    tokens, _ = follow_up(client, server, messages, marsched(conversation="chat-multi", retain=False))
    after = scheduler(server)
    assert after["retention_hits"] - before["retention_hits"] == 3  # turns 2 and 3, and the answer
    fresh, _ = follow_up(client, server, messages, {"cache_salt": "fresh-multi"})
    assert tokens == fresh
    wait_for(server, lambda s: s["retained_preserve"] == s["retained_swap"] == 0, "the last release")


def test_the_policy_preserves_a_short_tool_and_moves_a_long_one_off_the_device(server, client):
    before = scheduler(server)
    tool_turn(client, server, "chat-short", tool_s=0.0)  # nothing is wasted keeping it for no time
    state = wait_for(server, lambda s: s["retained_preserve"] == before["retained_preserve"] + 1, "a preserve")
    tool_turn(client, server, "chat-long", tool_s=3600.0)
    state = wait_for(server, lambda s: s["retained_swap"] == before["retained_swap"] + 1, "a swap")
    for conversation in ("chat-short", "chat-long"):
        response = server.client.delete(f"{server.url}/marsched/conversations/{conversation}")
        assert response.status_code == 202, response.text
    state = wait_for(server, lambda s: s["retained_preserve"] == s["retained_swap"] == 0, "the releases")
    if state["retention_released"] != before["retention_released"] + 2:
        pytest.fail(json.dumps({k: v for k, v in state.items() if k.startswith("ret")}))
    assert state["device_free_blocks"] == state["device_total_blocks"]


def test_a_follow_up_that_never_comes_is_freed_at_the_time_limit(server, client):
    before = scheduler(server)
    tool_turn(client, server, "chat-abandoned", strategy="preserve", tool_s=1.0)
    kept_t = time.monotonic()
    kept = wait_for(server, lambda s: s["retained_preserve"] == 1, "a preserve")
    assert kept["device_free_blocks"] < kept["device_total_blocks"]
    # Nothing reaches the engine (reading the state would wake it): it must wake by itself at the limit.
    time.sleep(max(kept_t + LIMIT_S + 1.5 - time.monotonic(), 0))
    freed = scheduler(server)  # the state the engine published at its last step
    assert freed["retained_preserve"] == 0, freed
    assert freed["retention_expired"] == before["retention_expired"] + 1
    assert freed["device_free_blocks"] == freed["device_total_blocks"]


def test_seed_is_a_400_on_the_cpu_engine_and_the_server_goes_on(server, client):
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from marsched.vllm.validate import check_sampling_params

    check_sampling_params(SimpleNamespace(seed=3, extra_args=None), on_cpu=False)  # a GPU takes it
    with pytest.raises(VLLMValidationError, match="CPU Generator"):
        check_sampling_params(SimpleNamespace(seed=3, extra_args=None), on_cpu=True)
    # Refused whatever its length: the front end does not know whether the prefill will be chunked.
    long_prompt = [{"role": "user", "content": "tools " * 200}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=server.model, messages=long_prompt, max_tokens=2, seed=1)
    assert "seed" in str(raised.value) and "CPU" in str(raised.value)
    answer = client.chat.completions.create(model=server.model, messages=long_prompt, max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_bad_conversation_fields_are_named_in_the_400(server, client):
    for fields, named in (({"conversation": ""}, "marsched.conversation"),
                          ({"conversation": "x" * 257}, "marsched.conversation"),
                          ({"conversation": "team/7"}, "marsched.conversation"),  # its DELETE path could not hold it
                          ({"conversation": "c", "tool_s": -1}, "marsched.tool_s"),
                          ({"conversation": "c", "retain": "no"}, "marsched.retain")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body=marsched(**fields))
        assert named in str(raised.value)
    bad = server.client.delete(f"{server.url}/marsched/conversations/" + "x" * 300)
    assert bad.status_code == 400
    assert server.client.get(f"{server.url}/marsched/conversations/c").status_code == 405
