"""Per-request information that travels with each input chunk to the scheduler.

It rides in `SamplingParams.extra_args["marsched"]`, which vLLM carries unchanged
into the scheduler's `Request.sampling_params` (every chunk of a resumable request
replaces the request's sampling params, so each chunk carries the current plan):

    {"segment": 1,                        # index of the segment this chunk starts
     "plan": [[out_tokens, api_type, api_s, return_tokens], ..., [out_tokens, null, 0, 0]],
     "strategy": "swap",                  # optional per-request override
     "rid": "req-7",                      # the caller's request id, for the trace
     "predicted": 120,                    # optional: the front end's predicted output tokens
                                          # of the segment this chunk starts (learned predictor)
     "conversation": "chat-42",           # optional: the conversation this request is a turn of
     "tool_s": 1.5,                       # optional: seconds until the conversation's next turn
     "tool": "get_weather",               # optional: the tool whose result this turn carries
     "retain": false}                     # optional: no next turn comes (default true)

A request with `conversation` is one turn of a multi-turn exchange (an OpenAI client's
tool call and the follow-up carrying the tool's result). When it finishes, the server
keeps its KV cache the way the policy decides from `tool_s` (or its prediction of the
gap) until the next request of the same conversation arrives, which reuses it, or a
time limit passes (`marsched.vllm.retention`).

`tool` names the tool whose RESULT this turn carries: the tool the previous turn called,
which the client knows when it sends this turn (it cannot know what this turn's reply will
call). The scheduler attributes the gap it observed before this turn to that tool, unless the
API server already told it which tools the previous reply called (a chat completion's
`tool_calls`, `marsched.vllm.tool_hints`); completions have no structured tool calls, so
there the field is the only way to learn a gap per tool.

`plan` is the caller's expectation of the whole request: for trace replay the true
trace request, for live tool use the expected output tokens per segment and, per
call, the tool's API type, expected duration and return length. The scheduler
builds a `marsched.workload.Request` from it; the configured predictor predicts
from that request (the oracle predictor takes it as the truth).

From the Python API the value is that dict. Over HTTP, vLLM's OpenAI server types
`vllm_xargs` values as strings, numbers or flat lists, so a client sends the same
object as a JSON string: `"vllm_xargs": {"marsched": "{\"plan\": [[64, null, 0, 0]]}"}`.

`parse` is the one definition of what is valid. The front end runs it on every
request (`marsched.vllm.validate.MarsRequestValidator`, a vLLM logits-processor
`validate_params` hook: a bad value is an HTTP 400 that names the field, and never
reaches the engine core); the scheduler runs it again (`decode`) and ends only the
request if it still fails.

Requests without this entry (plain clients of `vllm serve`) are taken as one
segment of `max_tokens` tokens.

This module does not import vllm.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from marsched.policy import Strategy
from marsched.workload.model import ApiCall, ApiType, Request, build_request

KEY = "marsched"

# Bounds on what a client may declare: far beyond any real request, small enough that
# every formula of the policy stays finite and a plan stays cheap to rank.
MAX_SEGMENTS = 1024
MAX_TOKENS = 10_000_000
MAX_API_S = 1_000_000.0
MAX_RID_CHARS = 1024
MAX_JSON_CHARS = 100_000
MAX_CONVERSATION_CHARS = 256
MAX_TOOL_CHARS = 64  # OpenAI's limit on a function's name
FIELDS = ("segment", "plan", "strategy", "rid", "predicted", "conversation", "tool_s", "retain", "tool")
# Kept in a tool's name: letters and digits (any script), `_`, `.`, `-`. The rest becomes `_`, so that
# a name never holds the separators of a tool hint (`tool_hints.py`).
_NOT_IN_TOOL_NAME = re.compile(r"[^\w.\-]")
PLAN_ITEM = ("output_tokens", "api_type", "api_s", "return_tokens")


class MetadataError(ValueError):
    """A marsched field a client sent is not valid; `field` names it (`marsched.plan[1][2]`), and the
    message adds what the field is (`marsched.plan[1][2] (api_s): must be a finite number, got inf`)."""

    def __init__(self, field: str, message: str, label: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field} ({label}): {message}" if label else f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class PlannedSegment:
    output_tokens: int
    api_type: ApiType | None = None  # None: the last segment
    api_s: float = 0.0
    return_tokens: int = 0

    def to_list(self) -> list[Any]:
        return [self.output_tokens, self.api_type.value if self.api_type else None, self.api_s, self.return_tokens]

    @classmethod
    def from_list(cls, item: Any, field: str = f"{KEY}.plan[]") -> "PlannedSegment":
        if not isinstance(item, (list, tuple)) or len(item) != len(PLAN_ITEM):
            raise MetadataError(field, "must be a list [output_tokens, api_type, api_s, return_tokens], "
                                       f"got {_show(item)}")
        out, api, api_s, ret = item
        return cls(
            _integer(out, f"{field}[0]", 0, MAX_TOKENS, PLAN_ITEM[0]),
            _api_type(api, f"{field}[1]", PLAN_ITEM[1]),
            _number(api_s, f"{field}[2]", 0.0, MAX_API_S, PLAN_ITEM[2]),
            _integer(ret, f"{field}[3]", 0, MAX_TOKENS, PLAN_ITEM[3]),
        )


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    segment: int
    plan: tuple[PlannedSegment, ...]
    strategy: Strategy | None = None
    request_id: str | None = None  # the caller's id (vLLM's internal id adds a random suffix)
    predicted: int | None = None  # the front end's prediction of this segment's output tokens
    conversation: str | None = None  # the conversation this request is a turn of
    tool_s: float | None = None  # the client's estimate of the time until the next turn
    retain: bool = True  # False: the conversation's last turn, nothing to keep
    tool: str | None = None  # the tool whose result this turn carries (the previous turn's call)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"segment": self.segment, "plan": [p.to_list() for p in self.plan]}
        if self.strategy is not None:
            data["strategy"] = self.strategy.value
        if self.request_id is not None:
            data["rid"] = self.request_id
        if self.predicted is not None:
            data["predicted"] = self.predicted
        if self.conversation is not None:
            data["conversation"] = self.conversation
        if self.tool_s is not None:
            data["tool_s"] = self.tool_s
        if not self.retain:
            data["retain"] = False
        if self.tool is not None:
            data["tool"] = self.tool
        return data

    def to_extra_args(self) -> dict[str, Any]:
        """`SamplingParams.extra_args` for the Python API."""
        return {KEY: self.to_dict()}

    def to_vllm_xargs(self) -> dict[str, str]:
        """`vllm_xargs` of an OpenAI-API request body (the object as a JSON string)."""
        return {KEY: json.dumps(self.to_dict(), separators=(",", ":"))}


def parse(value: Any) -> ChunkMeta | None:
    """Check and decode the value of `extra_args["marsched"]` / `vllm_xargs["marsched"]`.

    A dict (Python API) or a JSON string of one (HTTP); None means none was sent.
    Raises `MetadataError` naming the first field that is wrong.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_JSON_CHARS:
            raise MetadataError(KEY, f"longer than {MAX_JSON_CHARS} characters")
        try:
            value = json.loads(value, parse_constant=_no_constant)
        except (ValueError, RecursionError) as error:
            raise MetadataError(KEY, f"not valid JSON ({error}); send a JSON object as a string, "
                                     'e.g. "{\\"plan\\": [[64, null, 0, 0]]}"') from None
    if not isinstance(value, dict):
        raise MetadataError(KEY, f"must be a JSON object with keys {', '.join(FIELDS)}, got {_show(value)}")
    unknown = sorted(str(k) for k in value if k not in FIELDS)
    if unknown:
        raise MetadataError(f"{KEY}.{unknown[0]}", f"unknown key; valid: {', '.join(FIELDS)}")
    plan_value = value.get("plan")
    plan: tuple[PlannedSegment, ...] = ()
    if plan_value is not None:
        if not isinstance(plan_value, (list, tuple)):
            raise MetadataError(f"{KEY}.plan", f"must be a list of segments, got {_show(plan_value)}")
        if not 1 <= len(plan_value) <= MAX_SEGMENTS:
            raise MetadataError(f"{KEY}.plan", f"must have 1 to {MAX_SEGMENTS} segments, got {len(plan_value)}")
        plan = tuple(PlannedSegment.from_list(item, f"{KEY}.plan[{i}]") for i, item in enumerate(plan_value))
    segment = value.get("segment", 0)
    segment = 0 if segment is None else _integer(segment, f"{KEY}.segment", 0, MAX_SEGMENTS)
    strategy = value.get("strategy")
    if strategy is not None:
        valid = [s.value for s in Strategy]
        if not isinstance(strategy, str) or strategy not in valid:
            raise MetadataError(f"{KEY}.strategy", f"must be one of {', '.join(valid)} or null, got {_show(strategy)}")
        strategy = Strategy(strategy)
    rid = value.get("rid")
    if rid is not None and (not isinstance(rid, str) or not 1 <= len(rid) <= MAX_RID_CHARS):
        raise MetadataError(f"{KEY}.rid", f"must be a string of 1 to {MAX_RID_CHARS} characters, got {_show(rid)}")
    predicted = value.get("predicted")
    if predicted is not None:
        predicted = _integer(predicted, f"{KEY}.predicted", 1, MAX_TOKENS)
    conversation = value.get("conversation")
    if conversation is not None and (not isinstance(conversation, str) or "/" in conversation
                                     or not 1 <= len(conversation) <= MAX_CONVERSATION_CHARS):
        # No '/': the id is the last segment of its release path, DELETE /marsched/conversations/ID.
        raise MetadataError(f"{KEY}.conversation", f"must be a string of 1 to {MAX_CONVERSATION_CHARS} characters "
                                                   f"without '/', got {_show(conversation)}")
    tool_s = value.get("tool_s")
    if tool_s is not None:
        tool_s = _number(tool_s, f"{KEY}.tool_s", 0.0, MAX_API_S)
    retain = value.get("retain", True)
    if not isinstance(retain, bool):
        raise MetadataError(f"{KEY}.retain", f"must be true or false, got {_show(retain)}")
    tool = value.get("tool")
    if tool is not None:
        if not isinstance(tool, str) or not 1 <= len(tool) <= MAX_TOOL_CHARS:
            raise MetadataError(f"{KEY}.tool", f"must be a string of 1 to {MAX_TOOL_CHARS} characters "
                                               f"(the tool whose result this turn carries), got {_show(tool)}")
        tool = tool_name(tool)
    return ChunkMeta(segment, plan, strategy, rid, predicted, conversation, tool_s, retain, tool)


def tool_name(text: str) -> str:
    """A tool's name as the scheduler keys its gaps: at most MAX_TOOL_CHARS characters, each one
    that is not a letter, a digit, `_`, `.` or `-` replaced by `_` (the `tool` field and the
    names a model's reply calls go through the same rule, so that they meet)."""
    return _NOT_IN_TOOL_NAME.sub("_", text[:MAX_TOOL_CHARS])


def decode(sampling_params: Any) -> ChunkMeta | None:
    """The chunk's metadata from its `SamplingParams` (None: none sent); raises `MetadataError`."""
    extra = getattr(sampling_params, "extra_args", None)
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise MetadataError("extra_args", f"must be a dict, got {_show(extra)}")
    return parse(extra.get(KEY))


def workload_request(request_id: str, prompt_tokens: int, plan: tuple[PlannedSegment, ...], arrival_s: float) -> Request:
    """The workload-model request the policy predicts from; the last segment never has a call."""
    if not plan:
        plan = (PlannedSegment(1),)
    parts = []
    for index, seg in enumerate(plan):
        last = index == len(plan) - 1
        api = None if last or seg.api_type is None else ApiCall(seg.api_type, seg.api_s, seg.return_tokens)
        if not last and api is None:  # a segment inside the plan must end with a call
            api = ApiCall(ApiType.OTHER, seg.api_s, seg.return_tokens)
        parts.append((max(seg.output_tokens, 1), api))
    return build_request(request_id, max(prompt_tokens, 1), parts, arrival_s)


# --- checks -------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _show(value: Any) -> str:
    if isinstance(value, (str, int, float, bool, type(None))):
        text = json.dumps(value) if not (isinstance(value, int) and abs(value) > 10**30) else "a huge integer"
    else:
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(value: Any, field: str, low: int, high: int, label: str | None = None) -> int:
    if type(value) is not int:  # bool is not a count; 3.0 is not either
        raise MetadataError(field, f"must be an integer, got {_show(value)}", label)
    if not low <= value <= high:
        raise MetadataError(field, f"must be between {low} and {high}, got {_show(value)}", label)
    return value


def _number(value: Any, field: str, low: float, high: float, label: str | None = None) -> float:
    if type(value) not in (int, float):
        raise MetadataError(field, f"must be a number, got {_show(value)}", label)
    if isinstance(value, float) and not math.isfinite(value):
        raise MetadataError(field, f"must be a finite number, got {value}", label)
    if not low <= value <= high:
        raise MetadataError(field, f"must be between {low:g} and {high:g}, got {_show(value)}", label)
    return float(value)


def _api_type(value: Any, field: str, label: str | None = None) -> ApiType | None:
    if value is None:
        return None
    valid = [t.value for t in ApiType]
    if not isinstance(value, str) or value not in valid:
        raise MetadataError(field, f"must be one of {', '.join(valid)} or null, got {_show(value)}", label)
    return ApiType(value)
