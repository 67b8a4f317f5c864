"""What one probe client does, one action at a time: the fault mix of a real user population.

Each action sends its requests with `httpx` and returns an `Outcome`. A fault is a 5xx, a
request that gets no answer within `REQUEST_TIMEOUT_S`, a dropped connection the client did
not drop itself, or, on a marsched server, an answer of the wrong class (a 2xx to a malformed
marsched field, a 4xx to a valid turn). Stock vLLM knows no marsched field, DELETE or server
tool, so there only 5xx, hangs and dropped connections count.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from marsched.experiments.probe.fields import CHAT_PATH, COMPLETIONS_PATH, WEATHER, fuzz_body, verdict

REQUEST_TIMEOUT_S = 120.0
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
# Weights of the actions; `server_tool` only where the server has tools.
MIX = {"conversation": 4, "abandon": 1, "release": 1, "disconnect": 2, "malformed": 1, "oversized": 1,
       "fuzz": 3, "server_tool": 2, "plain": 2}
BAD_MARSCHED = ("garbage", "5", '{"plan": 5}', '{"strategy": "keep"}', '{"conversation": 7}',
                '{"colour": "red"}', '{"plan": [[4, "math", -1, 3]]}')


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    marsched: bool  # a marsched server: its fields are checked, DELETE and server tools exist
    server_tools: tuple[str, ...] = ()
    max_model_len: int = 512


@dataclass(slots=True)
class Outcome:
    action: str
    statuses: list[int] = field(default_factory=list)  # one per request sent; 0: no answer
    fault: str | None = None
    seconds: float = 0.0
    conversation: str | None = None  # kept on the server, unless released (abandon)


class Fault(Exception):
    """The action saw an answer no client should get."""


async def run_action(client: Any, target: Target, action: str, rng: random.Random) -> Outcome:
    outcome = Outcome(action)
    began = time.monotonic()
    try:
        await ACTIONS[action](client, target, rng, outcome)
    except Fault as fault:
        outcome.fault = str(fault)[:500]
    except Exception as error:  # noqa: BLE001 - a timeout or a dropped connection is the server's fault here
        outcome.statuses.append(0)
        outcome.fault = f"{type(error).__name__}: {error}"[:500]
    outcome.seconds = time.monotonic() - began
    return outcome


def choose(rng: random.Random, target: Target) -> str:
    names = [n for n in MIX if n != "server_tool" or target.server_tools]
    return rng.choices(names, weights=[MIX[n] for n in names])[0]


# --- the actions -------------------------------------------------------------------------------

async def conversation(client, target, rng, outcome, *, follow_up: bool = True, release: bool = False) -> None:
    """A tool call, the tool's time, the follow-up with its result (with stop strings or n=2)."""
    cid = outcome.conversation = f"probe-{rng.getrandbits(64):016x}"
    messages = [{"role": "user", "content": "what is the weather in oslo " * rng.randint(1, 20)}]
    first = await _send(client, target, outcome, CHAT_PATH, {
        "messages": messages, "tools": [WEATHER], "tool_choice": NAMED_WEATHER, "max_tokens": 24,
        "vllm_xargs": {"marsched": json.dumps({"conversation": cid, "tool_s": 0.5})}}, expect=200)
    if release:
        await _delete(client, target, outcome, cid)
    if not follow_up or release:
        return
    calls = first["choices"][0]["message"].get("tool_calls") or [
        {"id": "call-0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    await asyncio.sleep(rng.uniform(0.1, 1.0))
    messages += [{"role": "assistant", "content": None, "tool_calls": calls[:1]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 degrees"}]
    extra: dict[str, Any] = rng.choice([{}, {"stop": ["\n", " the"]}, {"n": 2}])
    await _send(client, target, outcome, CHAT_PATH, {
        "messages": messages, "max_tokens": 16, **extra,
        "vllm_xargs": {"marsched": json.dumps({"conversation": cid, "retain": False})}}, expect=200)
    outcome.conversation = None


async def abandon(client, target, rng, outcome) -> None:
    """A tool call whose follow-up never comes: the retention limit must free it."""
    await conversation(client, target, rng, outcome, follow_up=False)


async def release(client, target, rng, outcome) -> None:
    """A tool call, then the client releases the conversation (DELETE)."""
    await conversation(client, target, rng, outcome, release=True)
    outcome.conversation = None


async def disconnect(client, target, rng, outcome) -> None:
    """A streamed turn the client leaves after its first chunk (or before any). A reply that ended
    before the client left is a finished turn, kept until the retention limit: the outcome names it."""
    cid = outcome.conversation = f"probe-{rng.getrandbits(64):016x}"
    body = {"model": target.model, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 200, "stream": True,
            "vllm_xargs": {"marsched": json.dumps({"conversation": cid, "tool_s": 1.0})}}
    async with client.stream("POST", target.url + CHAT_PATH, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        outcome.statuses.append(response.status_code)
        _check_status(response.status_code, 200, target, await response.aread() if response.status_code != 200 else b"")
        if rng.random() < 0.7:
            async for _ in response.aiter_lines():
                break
    # leaving the block closes the connection mid-stream


async def malformed(client, target, rng, outcome) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": 4,
            "vllm_xargs": {"marsched": rng.choice(BAD_MARSCHED)}}
    await _send(client, target, outcome, COMPLETIONS_PATH, body, expect=400 if target.marsched else None)


async def oversized(client, target, rng, outcome) -> None:
    body = {"prompt": "word " * (target.max_model_len + rng.randint(1, 500)), "max_tokens": 4}
    await _send(client, target, outcome, COMPLETIONS_PATH, body, expect=400)


async def fuzz(client, target, rng, outcome) -> None:
    path, body = fuzz_body(rng, target.model)
    sent = {k: v for k, v in body.items() if k not in ("model", "messages", "prompt")}
    response = await client.post(target.url + path, json=body, timeout=REQUEST_TIMEOUT_S)
    outcome.statuses.append(response.status_code)
    judged = verdict(response.status_code, response.text, sent)
    if not judged.ok:
        raise Fault(f"fuzz {json.dumps(sent)[:300]}: {judged.why}")


async def server_tool(client, target, rng, outcome) -> None:
    name = rng.choice(target.server_tools)
    body = {"messages": [{"role": "user", "content": "use the tool for oslo"}], "max_tokens": 24,
            "tools": [{"type": "function", "function": {"name": name}}],
            "tool_choice": {"type": "function", "function": {"name": name}}}
    await _send(client, target, outcome, CHAT_PATH, body, expect=200)


async def plain(client, target, rng, outcome) -> None:
    await _send(client, target, outcome, COMPLETIONS_PATH, {"prompt": "the quick brown fox", "max_tokens": 8},
                expect=200)


ACTIONS = {"conversation": conversation, "abandon": abandon, "release": release, "disconnect": disconnect,
           "malformed": malformed, "oversized": oversized, "fuzz": fuzz, "server_tool": server_tool, "plain": plain}
assert set(ACTIONS) == set(MIX)


# --- HTTP ---------------------------------------------------------------------------------------

async def _send(client, target: Target, outcome: Outcome, path: str, body: dict, expect: int | None) -> dict:
    response = await client.post(target.url + path, json={"model": target.model, **body}, timeout=REQUEST_TIMEOUT_S)
    outcome.statuses.append(response.status_code)
    _check_status(response.status_code, expect, target, response.content)
    try:
        return response.json()
    except ValueError:
        return {}


async def _delete(client, target: Target, outcome: Outcome, cid: str) -> None:
    response = await client.delete(f"{target.url}/marsched/conversations/{cid}", timeout=REQUEST_TIMEOUT_S)
    outcome.statuses.append(response.status_code)
    _check_status(response.status_code, 202 if target.marsched else None, target, response.content)


def _check_status(status: int, expect: int | None, target: Target, content: bytes) -> None:
    if status >= 500:
        raise Fault(f"{status}: {content[:300]!r}")
    if expect is None or not target.marsched:
        return
    if status // 100 != expect // 100:
        raise Fault(f"expected {expect // 100}xx, got {status}: {content[:300]!r}")
