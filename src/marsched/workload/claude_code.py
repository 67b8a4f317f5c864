"""Claude Code sessions: real agent conversations, one per line, read as one request per task.

The file (``claude_code_sessions.jsonl``, optionally gzip-compressed; provenance in
``data/workloads/README.md``) holds one conversation per line: ``id``, ``block_size`` (64)
and ``requests``, the model calls in order. A call has ``t`` (seconds from the start of its
conversation), ``type`` (``n`` or ``s``: non-streaming, streaming), ``in`` and ``out``
(tokens), ``stop`` (``tool_use``, ``end_turn`` or ``""``), ``think_time`` (seconds between
the previous response and this call), ``blocks`` (``in // block_size``) and
``prefix_blocks`` (leading blocks identical to the previous call's input). An entry with
``type`` ``subagent`` is a nested conversation (``requests``, ``t``, ``duration_ms``) that a
tool call of its parent started. Other keys are ignored.

How a conversation becomes requests (docs/workloads.md says why):

- **A task is a request.** The calls up to one whose ``stop`` is not ``tool_use`` (the
  answer to the human: ``end_turn``, or ``""``, which in the bundled file is always
  followed by the human's text) make one request; call *i* is segment *i*. The human's
  time before the next task is not part of any request. The task's first input is its
  prompt (the conversation so far; nothing is cached across requests).
- **A tool gap is a call.** After a ``tool_use`` the next call's ``think_time`` (the tool's
  run and the client's overhead) is the duration of an `ApiType.TOOL` call.
- **A return is the context's growth.** Segment *i+1*'s context is call *i+1*'s ``in``. If
  the previous input survived whole (``prefix_blocks`` equals the previous ``blocks``)
  and the new input holds at least the context at the call (``in + out``), the call keeps
  that context and returns the difference. Otherwise the client rewrote the context
  (compaction, dropped thinking): the call keeps the ``prefix_blocks × block_size``
  tokens the data says are identical (`ApiCall.kept_tokens`) and returns the rest of the
  new input, which is computed again.
- **A trailing call.** A conversation whose last call stops on ``tool_use`` ends with that
  call: the trace stops before the tool returns, so the call takes 0 s and returns
  nothing (its duration is unknown; inventing one would lengthen the request).
- **Subagents.** A subagent's tasks are requests too, tied to their parent
  (`Request.spawned_by`): the parent's task and the segment whose ``tool_use`` call
  started it (the last call before the entry). Their ``arrival_s`` counts from the
  parent's arrival: the subagent's start in the recorded timeline (the entry's ``t``, its
  end, less ``duration_ms``) after the parent task's first call, plus, for a subagent's
  later tasks, their own offset. An entry with no ``tool_use`` call before it (2 in the
  bundled file, after an ``end_turn``) loads as standalone requests.
- **Conversations.** Each task carries its agent (`Request.conversation`), its start in the
  recorded conversation (``arrival_s``: its first call's ``t`` less the agent's first call's,
  counted from the parent's task for a subagent's) and, from the second task on, how it follows
  the task before (`FollowUp`): the human's time, the first call's ``think_time``, and the
  prompt's leading ``prefix_blocks × block_size`` tokens, which are that task's context. Session
  arrivals (`workload/sessions.py`) replay conversations with them; random draws ignore them.

Ids: ``<conversation>:t<k>`` for the k-th task (from 0), ``<conversation>:sa<j>:t<k>`` for
the tasks of the j-th subagent (from 1, in file order; deeper nesting adds ``:sa<j>``).
Every problem is a `TraceError` naming the file, the line and conversation, the call's
index in its list (``request 5``, ``request 5 (subagent) request 2``) and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from marsched.workload._checks import (
    Source,
    decode_utf8,
    gunzipped,
    object_line,
    read_trace_bytes,
    require_count,
    require_seconds,
)
from marsched.workload.errors import TraceError, describe
from marsched.workload.model import ApiCall, ApiType, FollowUp, Request, Spawn, build_request

TOOL_USE = "tool_use"
STOPS = (TOOL_USE, "end_turn", "")
CALL_TYPES = ("n", "s")
SUBAGENT = "subagent"


def load_claude_code(path: str | os.PathLike[str]) -> list[Request]:
    """Read a Claude Code sessions file (plain or gzip); raises TraceError naming file, conversation, call and field."""
    return parse_claude_code(read_trace_bytes(path), source=path)


def parse_claude_code(data: bytes | str, source: Source) -> list[Request]:
    """Parse the sessions (JSON Lines, or their gzip); `source` names them in errors."""
    text = decode_utf8(gunzipped(data, source), source)
    requests: list[Request] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        conversation = _conversation_record(line, number, source)
        name = conversation["id"]
        if name in first_line:
            raise TraceError(source, f"line {number} (conversation {name!r})", "id",
                             f"repeats the id of line {first_line[name]}")
        first_line[name] = number
        requests.extend(_conversation_requests(conversation, source, f"line {number} (conversation {name!r})"))
    if not requests:
        raise TraceError(source, "file", None, "contains no conversations")
    return requests


def is_claude_code(text: str) -> bool:
    """Whether JSON Lines text is Claude Code sessions: its first record has ``requests`` and no ``segments``."""
    for line in text.splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return False
            return isinstance(record, dict) and "requests" in record and "segments" not in record
    return False


# --- records -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Call:
    """One model call of an agent, as read and checked."""

    where: str
    t: float
    input_tokens: int
    output_tokens: int
    stop: str
    think_time: float | None
    blocks: int
    prefix_blocks: int


@dataclass(frozen=True, slots=True)
class _Subagent:
    """A nested conversation and the position of the parent's call before it (-1: none)."""

    where: str
    start_s: float
    after_call: int
    items: list


def _conversation_record(line: str, number: int, source: Source) -> dict:
    return object_line(line, number, source, " (a conversation)")[0]


def _required(record: dict, key: str, source: Source, where: str) -> object:
    if key not in record:
        raise TraceError(source, where, key, "missing")
    return record[key]


def _item_list(value: object, source: Source, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise TraceError(source, where, "requests", f"must be a non-empty list, got {describe(value)}")
    return value


def _block_size(record: dict, source: Source, where: str) -> int:
    size = require_count(_required(record, "block_size", source, where), source, where, "block_size")
    if size == 0:
        raise TraceError(source, where, "block_size", "must be at least 1, got 0 (int)")
    return size


def _read_agent(items: list, block_size: int, source: Source, where: str) -> tuple[list[_Call], list[_Subagent]]:
    """An agent's calls in order, each checked against the one before it, and its subagents."""
    calls: list[_Call] = []
    subagents: list[_Subagent] = []
    for index, item in enumerate(items):
        at = f"{where} request {index}"
        if not isinstance(item, dict):
            raise TraceError(source, at, None, f"must be a JSON object, got {describe(item)}")
        kind = _required(item, "type", source, at)
        if kind == SUBAGENT:
            subagents.append(_subagent(item, len(calls) - 1, source, at))
        elif kind in CALL_TYPES:
            calls.append(_call(item, calls[-1] if calls else None, block_size, source, at))
        else:
            raise TraceError(source, at, "type", f"must be one of n, s, subagent, got {describe(kind)}")
    if not calls:
        raise TraceError(source, where, "requests", "has no model call (only subagents)")
    return calls, subagents


def _call(item: dict, previous: _Call | None, block_size: int, source: Source, where: str) -> _Call:
    t = require_seconds(_required(item, "t", source, where), source, where, "t")
    tokens_in = require_count(_required(item, "in", source, where), source, where, "in")
    tokens_out = require_count(_required(item, "out", source, where), source, where, "out")
    stop = _required(item, "stop", source, where)
    if stop not in STOPS:
        raise TraceError(source, where, "stop", f"must be one of 'tool_use', 'end_turn', '', got {describe(stop)}")
    think_time = None
    if previous is not None and previous.stop == TOOL_USE:  # the tool's time: the call before this one's duration
        think_time = require_seconds(_required(item, "think_time", source, where), source, where, "think_time")
    elif previous is not None and "think_time" in item:  # the human's time after an answer
        think_time = require_seconds(item["think_time"], source, where, "think_time")
    blocks = require_count(_required(item, "blocks", source, where), source, where, "blocks")
    if blocks != tokens_in // block_size:
        raise TraceError(source, where, "blocks", f"must be in // block_size = {tokens_in // block_size}, got {blocks}")
    prefix = require_count(_required(item, "prefix_blocks", source, where), source, where, "prefix_blocks")
    if previous is not None and prefix > previous.blocks:
        raise TraceError(source, where, "prefix_blocks",
                         f"{prefix} is more than the previous request's {previous.blocks} blocks")
    if prefix > blocks:
        raise TraceError(source, where, "prefix_blocks", f"{prefix} is more than this request's {blocks} blocks")
    return _Call(where, t, tokens_in, tokens_out, stop, think_time, blocks, prefix)


def _subagent(item: dict, after_call: int, source: Source, where: str) -> _Subagent:
    where = f"{where} (subagent)"
    end_s = require_seconds(_required(item, "t", source, where), source, where, "t")
    duration_ms = require_seconds(_required(item, "duration_ms", source, where), source, where, "duration_ms")
    items = _item_list(_required(item, "requests", source, where), source, where)
    return _Subagent(where, max(end_s - duration_ms / 1000.0, 0.0), after_call, items)


# --- conversations to requests -------------------------------------------------------------


def _conversation_requests(record: dict, source: Source, where: str) -> list[Request]:
    block_size = _block_size(record, source, where)
    items = _item_list(_required(record, "requests", source, where), source, where)
    counter = [0]  # subagents numbered in file order across the conversation
    return _agent_requests(items, record["id"], None, block_size, source, where, counter)


def _agent_requests(items: list, agent: str, spawn: tuple[Spawn, float] | None, block_size: int, source: Source,
                    where: str, counter: list[int]) -> list[Request]:
    """The agent's tasks as requests, each followed by those of the subagents it starts.

    `spawn` (the parent's call and the agent's start, seconds after the parent task's first
    call) ties a subagent's tasks to its parent.
    """
    calls, subagents = _read_agent(items, block_size, source, where)
    tasks = _tasks(calls)
    task_of = {id(call): (number, index) for number, task in enumerate(tasks) for index, call in enumerate(task)}
    requests: list[list[Request]] = [[] for _ in tasks]
    for number, task in enumerate(tasks):
        request = _task_request(f"{agent}:t{number}", task, number == len(tasks) - 1, block_size, source)
        request = replace(request, conversation=agent, arrival_s=task[0].t - calls[0].t,
                          follows=_follow_up(f"{agent}:t{number - 1}", tasks[number - 1], task[0], block_size)
                          if number else None)
        if spawn is not None:
            parent, start_s = spawn
            request = replace(request, spawned_by=parent, arrival_s=start_s + request.arrival_s)
        requests[number].append(request)
    for subagent in subagents:
        counter[0] += 1
        name = f"{agent}:sa{counter[0]}"
        parent_call = calls[subagent.after_call] if subagent.after_call >= 0 else None
        if parent_call is None or parent_call.stop != TOOL_USE:
            # No call of the parent started it (the trace lost that call): it stands alone.
            requests[-1].extend(_agent_requests(subagent.items, name, None, block_size, source, subagent.where, counter))
            continue
        number, index = task_of[id(parent_call)]
        offset = max(subagent.start_s - tasks[number][0].t, parent_call.t - tasks[number][0].t)
        tie = (Spawn(f"{agent}:t{number}", index), offset)
        requests[number].extend(_agent_requests(subagent.items, name, tie, block_size, source, subagent.where, counter))
    return [request for group in requests for request in group]


def _tasks(calls: list[_Call]) -> list[list[_Call]]:
    """Calls grouped into tasks: each task ends at a call that does not stop on tool_use, or at the end."""
    tasks: list[list[_Call]] = [[]]
    for call in calls:
        tasks[-1].append(call)
        if call.stop != TOOL_USE:
            tasks.append([])
    return [task for task in tasks if task]


def _follow_up(previous_id: str, previous: list[_Call], first: _Call, block_size: int) -> FollowUp:
    """How a task follows the one before it: the human's time (the first call's ``think_time``, or
    the time since the previous task's last call where the file has none), and the leading
    blocks its first input shares with that call's input (``prefix_blocks``)."""
    gap = first.think_time if first.think_time is not None else max(first.t - previous[-1].t, 0.0)
    return FollowUp(previous_id, gap, first.prefix_blocks * block_size)


def _task_request(request_id: str, task: list[_Call], last_task: bool, block_size: int, source: Source) -> Request:
    parts: list[tuple[int, ApiCall | None]] = []
    for call, following in zip(task, task[1:]):
        parts.append((call.output_tokens, _tool_call(call, following, block_size)))
    final = task[-1]
    trailing = final.stop == TOOL_USE  # only the agent's very last call can end a task on tool_use
    assert not trailing or last_task
    parts.append((final.output_tokens, ApiCall(ApiType.TOOL, 0.0, 0) if trailing else None))
    try:
        return build_request(request_id, task[0].input_tokens, parts)
    except ValueError as error:  # not reachable from checked records; named all the same
        raise TraceError(source, task[0].where, None, str(error)) from None


def _tool_call(call: _Call, following: _Call, block_size: int) -> ApiCall:
    """The tool call between two calls of a task: its duration, what it keeps and what it returns."""
    at_call = call.input_tokens + call.output_tokens
    assert following.think_time is not None  # checked when read: it follows a tool_use
    if following.prefix_blocks == call.blocks and following.input_tokens >= at_call:
        return ApiCall(ApiType.TOOL, following.think_time, following.input_tokens - at_call)
    kept = following.prefix_blocks * block_size  # <= call.input_tokens <= at_call, and <= following's input
    return ApiCall(ApiType.TOOL, following.think_time, following.input_tokens - kept, kept_tokens=kept)
