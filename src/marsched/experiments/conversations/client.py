"""The benchmark's client: one conversation's turns, streamed with the official `openai` client.

Measured per turn: the time to the first content or tool-call delta (TTFT) and the turn's
latency; per conversation: arrival to the last token of its answer, tool time included.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

from marsched.experiments.conversations.load import Conversation, Load, marsched_xargs

# The random model fills enum-constrained arguments reliably under xgrammar (free-form JSON it does not).
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a city up.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "oslo", "lima", "kyiv"]}},
                   "required": ["city"]}}}
TOOL_CHOICE = {"type": "function", "function": {"name": "lookup"}}
REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Turn:
    cid: str
    index: int  # 0: the prompt; 1..k: follow-ups (k: the answer)
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class ConversationResult:
    cid: str
    arrival_s: float
    e2e_s: float | None = None
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


async def run_turn(client: Any, model: str, messages: list[dict], turn: Turn, *, tool: bool, load: Load,
                   clock0: float) -> dict | None:
    """Send one streamed turn; fill `turn`; return the assistant's tool call (None for the answer)."""
    extra: dict[str, Any] = {}
    xargs = marsched_xargs(load, turn.cid, last=not tool)
    if xargs:
        extra["vllm_xargs"] = xargs
    if tool:
        kwargs: dict[str, Any] = {"tools": [TOOL], "tool_choice": TOOL_CHOICE, "max_tokens": 24}
    else:
        kwargs = {"max_tokens": load.answer_tokens}
        extra["ignore_eos"] = True  # every answer is answer_tokens long: the same work for every server
    name, arguments, call_id = "", "", None
    started = time.monotonic()
    turn.sent_s = started - clock0
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True},
        # No `seed`: greedy decoding needs none, and a seeded request whose prefill is chunked crashes
        # vLLM's CPU engine (marsched serve refuses it with a 400).
        temperature=0.0, extra_body=extra, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            turn.prompt_tokens = chunk.usage.prompt_tokens
            turn.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            if choice.finish_reason:
                turn.finish_reason = choice.finish_reason
            produced = bool(delta.content)
            for call in delta.tool_calls or []:
                call_id = call.id or call_id
                if call.function is not None:
                    name += call.function.name or ""
                    arguments += call.function.arguments or ""
                    produced = produced or bool(call.function.arguments)
            if produced and turn.ttft_s is None:  # a role-only first chunk is not a token
                turn.ttft_s = time.monotonic() - started
    turn.latency_s = time.monotonic() - started
    if not tool:
        return None
    return {"id": call_id or f"call-{turn.cid}-{turn.index}", "type": "function",
            "function": {"name": name or "lookup", "arguments": arguments or "{}"}}


async def run_conversation(client: Any, model: str, conv: Conversation, load: Load, clock0: float) -> ConversationResult:
    result = ConversationResult(conv.cid, conv.arrival_s)
    await asyncio.sleep(max(0.0, clock0 + conv.arrival_s - time.monotonic()))
    arrived = time.monotonic()
    messages: list[dict] = [{"role": "user", "content": conv.prompt}]
    try:
        for index in range(load.tool_turns + 1):
            turn = Turn(conv.cid, index, 0.0)
            result.turns.append(turn)
            tool = index < load.tool_turns
            call = await run_turn(client, model, messages, turn, tool=tool, load=load, clock0=clock0)
            if call is None:
                break
            await asyncio.sleep(conv.tool_s[index])  # the tool runs
            messages = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": call["id"], "content": conv.results[index]}]
        result.e2e_s = time.monotonic() - arrived
    except Exception as error:  # noqa: BLE001 - one failed conversation is a result, not the end of the run
        result.error = f"{type(error).__name__}: {error}"[:500]
        if result.turns and result.turns[-1].latency_s is None:
            result.turns[-1].error = result.error
    return result


async def run_load(url: str, model: str, conversations: list[Conversation], load: Load) -> list[ConversationResult]:
    from openai import APIError, AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
        # Two unmeasured turns first: the first tool call pays for the grammar's compilation; the
        # answer turn carries the conversation keys (retain false: nothing is kept), so a server
        # that refuses them stops the run here rather than failing every conversation.
        hello = [{"role": "user", "content": "warm up"}]
        await run_turn(client, model, hello, Turn("warmup", 0, 0.0), tool=True,
                       load=replace(load, conversation_keys=False), clock0=time.monotonic())
        try:
            await run_turn(client, model, hello, Turn("warmup", 1, 0.0), tool=False, load=load,
                           clock0=time.monotonic())
        except APIError as error:  # streamed: a refused field arrives as an error event, not a 400
            raise RuntimeError(f"the server refused a turn with the conversation keys ({error}); "
                               "for a marsched without conversation retention add --no-conversation-keys") from error
        clock0 = time.monotonic() + 0.5
        return list(await asyncio.gather(*(run_conversation(client, model, c, load, clock0) for c in conversations)))
