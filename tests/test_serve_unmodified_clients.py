"""Unmodified clients on a live `marsched serve` (the session's chat server, `servers.CHAT`): no
marsched field, no conversation id, no header of ours anywhere.

The official `openai` SDK (chat completions, Responses and completions, streamed and not) and the OpenAI Agents
SDK (`openai-agents`: an agent with a function tool, on its chat-completions and its Responses
model) run multi-turn tool loops. A named or required `tool_choice` makes the random-weight model
write valid calls under vLLM's structured outputs; that is all the help it gets. The server must
recognise each follow-up by its prompt (`marsched.vllm.follow_ups`), start the tool pause from
the reply (`marsched.serve.tool_gaps`; on completions, the server's tool-call parser reads the
text) and keep the turn's KV: >= 95% of follow-ups are retention
hits by `/metrics`, and each conversation's turns arrive as one inferred program in the trace.
Every conversation starts with the same system prompt, so only its own turns may match it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from servers import CITY, Server, openai_client  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SYSTEM = "you are a helpful agent " * 6  # every conversation's, so their first blocks are alike
TURNS = 3  # tool-call turns per conversation; an answer follows them
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                              "parameters": CITY}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
                  "parameters": CITY}
HIT_SHARE = 0.95


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def counters(server: Server) -> dict[str, float]:
    """The retention and follow-up counters of `/metrics`, summed over ranks."""
    totals: dict[str, float] = {}
    for line in server.client.get(server.url + "/metrics").text.splitlines():
        if line.startswith(("marsched_retention_", "marsched_follow_ups_")) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def trace_length(server: Server) -> int:
    return len(server.trace.read_text().splitlines()) if server.trace.exists() else 0


def arrivals_since(server: Server, start: int, expected: int, timeout_s: float = 30.0) -> list[dict]:
    """The `arrive` events written after line `start`, once there are `expected` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = server.trace.read_text().splitlines()[start:]
        events = [json.loads(line) for line in lines if line.strip()]
        arrivals = [e for e in events if e["event"] == "arrive"]
        if len(arrivals) >= expected or time.monotonic() > deadline:
            return arrivals
        time.sleep(0.2)


def check(server: Server, before: dict, start: int, first_ids: list[str], requests_each: int) -> dict:
    """>= 95% of the follow-ups were hits; each conversation (by its first reply's id) is one program."""
    follow_ups = len(first_ids) * (requests_each - 1)
    after = counters(server)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    hits = delta["marsched_retention_hits_total"]
    assert hits >= HIT_SHARE * follow_ups, f"{hits} retention hits of {follow_ups} follow-ups: {delta}"
    assert delta["marsched_follow_ups_matched_total"] == follow_ups, delta
    arrivals = arrivals_since(server, start, len(first_ids) * requests_each)
    assert all("program" in e for e in arrivals), arrivals
    programs: dict[str, list[dict]] = {}
    for event in arrivals:
        programs.setdefault(event["program"], []).append(event)
    assert len(programs) == len(first_ids), sorted(programs)
    for events in programs.values():
        assert len(events) == requests_each and {e["identity"] for e in events} == {"inferred"}, events
        assert all("carried" in e for e in events[1:]), events  # the program's clock goes on across turns
    for first_id in filter(None, first_ids):  # the Agents SDK's chat model keeps no reply id
        # The engine's request id is the reply's id and a suffix; the program is named after the first.
        assert sum(program.startswith(f"auto-{first_id}") for program in programs) == 1, (first_id, sorted(programs))
    return {"follow_ups": follow_ups, "hits": hits, "misses": delta["marsched_retention_misses_total"]}


# --- the openai SDK --------------------------------------------------------------------------------


def chat_turn(client, server: Server, messages: list, stream: bool) -> tuple[str, dict]:
    """One tool-call turn: the reply's id and the assistant message as the client appends it."""
    request = dict(model=server.model, messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=40,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        response = client.chat.completions.create(**request)
        message = response.choices[0].message
        assert message.tool_calls, response
        return response.id, message.model_dump(exclude_none=True)
    calls: dict[int, dict] = {}
    reply_id = None
    for chunk in client.chat.completions.create(stream=True, **request):
        reply_id = chunk.id
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    assert calls and calls[0]["function"]["name"] == "get_weather", calls
    return reply_id, {"role": "assistant", "content": None, "tool_calls": list(calls.values())}


def chat_conversation(client, server: Server, name: str, stream: bool) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{name} what is the weather in paris"}]
    first_id = None
    for turn in range(TURNS):
        reply_id, message = chat_turn(client, server, messages, stream)
        first_id = first_id or reply_id
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                               "content": f"sunny and {20 + turn} degrees"}]
    client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=4)
    return first_id


def responses_turn(client, server: Server, items: list, stream: bool) -> tuple[str, list]:
    """One tool-call turn on /v1/responses: the reply's id and its function_call items."""
    request = dict(model=server.model, input=items, instructions=SYSTEM, tools=[RESPONSES_TOOL], temperature=0,
                   max_output_tokens=40, tool_choice={"type": "function", "name": "get_weather"})
    if not stream:
        response = client.responses.create(**request)
    else:
        response = None
        for event in client.responses.create(stream=True, **request):
            if event.type == "response.completed":
                response = event.response
        assert response is not None, "the stream never completed"
    calls = [item.model_dump(exclude_none=True) for item in response.output if item.type == "function_call"]
    assert calls, response.output
    return response.id, calls


def responses_conversation(client, server: Server, name: str, stream: bool) -> str:
    items: list = [{"role": "user", "content": f"{name} what is the weather in paris"}]
    first_id = None
    for turn in range(TURNS):
        reply_id, calls = responses_turn(client, server, items, stream)
        first_id = first_id or reply_id
        items += calls + [{"type": "function_call_output", "call_id": calls[0]["call_id"],
                           "output": f"sunny and {20 + turn} degrees"}]
    client.responses.create(model=server.model, input=items, instructions=SYSTEM, temperature=0, max_output_tokens=4)
    return first_id


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_openai_sdk_gets_its_follow_ups_kept_with_no_field_of_ours(server, client, api):
    run = uuid.uuid4().hex[:8]  # a rerun on the same server continues none of these
    before, start = counters(server), trace_length(server)
    conversation = chat_conversation if api == "chat" else responses_conversation
    first_ids = [conversation(client, server, f"{api}-{run}-{index}", stream=index % 2 == 1) for index in range(4)]
    print(check(server, before, start, first_ids, TURNS + 1))


# --- completions: the server's tool-call parser reads the text ----------------------------------

CALL = "[get_weather(city='paris')]"  # the pythonic parser's syntax, which the test servers use


def completion_text(client, server: Server, prompt: str, stream: bool, pattern: str) -> tuple[str, str]:
    """One completion forced to `pattern` by structured outputs: its id and text."""
    request = dict(model=server.model, prompt=prompt, temperature=0, max_tokens=40,
                   extra_body={"structured_outputs": {"regex": pattern}})
    if not stream:
        response = client.completions.create(**request)
        assert response.choices[0].finish_reason == "stop", response
        return response.id, response.choices[0].text
    reply_id, text = None, ""
    for chunk in client.completions.create(stream=True, **request):
        reply_id = chunk.id
        text += "".join(choice.text for choice in chunk.choices)
    return reply_id, text


def completion_conversation(client, server: Server, name: str, stream: bool, pattern: str) -> str:
    prompt = f"{SYSTEM}\n{name} what is the weather in paris\n"
    first_id = None
    for turn in range(TURNS):
        reply_id, text = completion_text(client, server, prompt, stream, pattern)
        first_id = first_id or reply_id
        prompt += text + f"\nresult sunny and {20 + turn} degrees\n"
    client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=4)
    return first_id


def test_a_completions_tool_loop_gets_its_follow_ups_kept_by_the_parser(server, client):
    run = uuid.uuid4().hex[:8]
    before, start = counters(server), trace_length(server)
    pattern = CALL.replace("[", "\\[").replace("]", "\\]").replace("(", "\\(").replace(")", "\\)")
    first_ids = [completion_conversation(client, server, f"completions-{run}-{index}", index % 2 == 1, pattern)
                 for index in range(4)]
    print(check(server, before, start, first_ids, TURNS + 1))
    # The same loop whose replies are text the parser reads no call in: recognised, and nothing kept.
    before = counters(server)
    completion_conversation(client, server, f"completions-{run}-plain", False, "sunny and warm")
    after = counters(server)
    assert after["marsched_follow_ups_matched_total"] - before["marsched_follow_ups_matched_total"] == TURNS
    assert after["marsched_retention_hits_total"] == before["marsched_retention_hits_total"]


# --- the OpenAI Agents SDK ---------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_openai_agents_sdk_agent_gets_its_follow_ups_kept(server, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["paris", "oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny and 20 degrees in {city}"

    def after_three_calls(context, results) -> agents.ToolsToFinalOutputResult:
        """The agent's own loop, ended by the SDK's hook once the tool has run TURNS times (the random
        model would never end it; a reply of `auto` tool choice is random text to its length cap,
        which the Responses model refuses as incomplete)."""
        done = len(calls) % TURNS == 0
        return agents.ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output if done else None)

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as sdk_client:
            model_class = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
            model = model_class(model=server.model, openai_client=sdk_client)
            # `required` on chat (a JSON list of calls under structured outputs; one call, not parallel);
            # Responses turns `required` into no grammar in vLLM 0.32, so the tool is named there.
            choice = "required" if api == "chat" else "get_weather"
            agent = agents.Agent(name="weather", instructions=SYSTEM, tools=[get_weather], model=model,
                                 tool_use_behavior=after_three_calls, reset_tool_choice=False,
                                 model_settings=agents.ModelSettings(tool_choice=choice, parallel_tool_calls=False,
                                                                     max_tokens=120, temperature=0))
            first_ids = []
            for index in range(3):
                result = await agents.Runner.run(agent, f"agent-{api}-{run}-{index} what is the weather in paris",
                                                 max_turns=TURNS + 1)
                assert len(result.raw_responses) == TURNS, result.new_items
                assert str(result.final_output).startswith("sunny"), result.final_output
                first_ids.append(result.raw_responses[0].response_id)
            return first_ids

    run = uuid.uuid4().hex[:8]
    before, start = counters(server), trace_length(server)
    first_ids = asyncio.run(run_all())
    print(check(server, before, start, first_ids, TURNS))
