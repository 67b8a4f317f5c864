"""The gap between a conversation's turns, learned per tool on a live `marsched serve` (the session's
chat server, `servers.CHAT`), driven by the official `openai` client.

Two client-side tools, one fast and one slow, are called again and again in conversations (a
named `tool_choice` makes the random-weight model call the one asked for), the client sleeping
each tool's time before the follow-up; half the turns stream. The API server tells the scheduler
which tool each reply called (`marsched.serve.tool_gaps`), the scheduler attributes each gap to
that tool, and `/marsched/state` ends up with one estimate per tool, near its sleep.
"""

from __future__ import annotations

import math
import threading

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import CITY, Server, marsched, openai_client  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SLEEPS_S = {"fast_lookup": 0.3, "slow_search": 1.5}  # names no other test's tool has
TOOLS = [{"type": "function", "function": {"name": name, "description": f"a tool that takes {s} s",
                                           "parameters": CITY}} for name, s in SLEEPS_S.items()]
TURNS = 4  # tool turns per conversation: as many gaps
CONVERSATIONS = 2  # per tool, one streamed, one not
OVERHEAD_S = 3.0  # at most, on top of the sleep: the reply's way to the client, the next turn's way in (a loaded machine)


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def call_tool(client, server: Server, messages: list, tool: str, conversation: str, rid: str, stream: bool) -> dict:
    """One tool turn; the assistant message with its tool call, as the client appends it."""
    request = dict(model=server.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=40,
                   tool_choice={"type": "function", "function": {"name": tool}},
                   extra_body=marsched(conversation=conversation, rid=rid))
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == tool, message
        return message.model_dump(exclude_none=True)
    call = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    for chunk in client.chat.completions.create(stream=True, **request):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call["id"] = delta_call.id or call["id"]
            if delta_call.function is not None:
                call["function"]["name"] += delta_call.function.name or ""
                call["function"]["arguments"] += delta_call.function.arguments or ""
    assert call["function"]["name"] == tool, call
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def conversation(client, server: Server, tool: str, index: int, stream: bool, errors: list) -> None:
    name = f"gaps-{tool}-{index}"
    try:
        messages = [{"role": "user", "content": f"{name}: what is the weather in paris"}]
        for turn in range(TURNS):
            message = call_tool(client, server, messages, tool, name, f"{name}-{turn}", stream)
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"}]
            threading.Event().wait(SLEEPS_S[tool])  # the tool runs
        client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=4,
                                       extra_body=marsched(conversation=name, retain=False))
    except Exception as error:  # noqa: BLE001 - reported by the test
        errors.append(f"{name}: {type(error).__name__}: {error}")


def own_mean_s(estimate_s: float, samples: int, global_s: float, k: float = 1.0) -> float:
    """The tool's own geometric mean, back from its shrunk estimate (`policy.retention.shrunk_gap_s`)."""
    return math.exp(((samples + k) * math.log(estimate_s) - k * math.log(global_s)) / samples)


def test_two_tools_get_two_estimates_near_their_times(server, client):
    before = server.state()["scheduler"].get("tool_gaps", {})
    assert not set(before) & set(SLEEPS_S)
    errors: list[str] = []
    threads = [threading.Thread(target=conversation, args=(client, server, tool, index, index % 2 == 1, errors))
               for tool in SLEEPS_S for index in range(CONVERSATIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    state = server.state()["scheduler"]
    gaps = state["tool_gaps"]
    owns = {}
    for tool, sleep_s in SLEEPS_S.items():
        learned = gaps[tool]
        # Every gap went to its tool: each reply's hint reached the scheduler before the follow-up.
        assert learned["samples"] == TURNS * CONVERSATIONS, (tool, learned)
        own = own_mean_s(learned["estimate_s"], learned["samples"], state["tool_gap_global_s"])
        assert sleep_s <= own <= sleep_s + OVERHEAD_S, (tool, own, learned, state["tool_gap_global_s"])
        owns[tool] = own
    # The two tools' overheads are alike, whatever the machine's load: their difference is the sleeps'.
    assert owns["slow_search"] - owns["fast_lookup"] >= 0.5 * (SLEEPS_S["slow_search"] - SLEEPS_S["fast_lookup"])
    assert gaps["slow_search"]["estimate_s"] > gaps["fast_lookup"]["estimate_s"]
    # A later turn's retention was decided from its tool's gap: the previous tool's until the hint,
    # the hint's after it (the same tool here).
    for tool in SLEEPS_S:
        response = server.client.get(server.url + "/marsched/state", params={"request_id": f"gaps-{tool}-0-2"})
        decided = response.json()["scheduler"]["request"]["retention"]
        assert decided["tools"] == [tool] and decided["gap_source"] in ("previous-tool", "hint"), decided
        assert decided["gap_s"] > 0 and decided["strategy"] in ("preserve", "swap", "discard")
