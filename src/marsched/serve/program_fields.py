"""Program fields that existing agent clients and routers send, read as marsched's own.

- vllm-project/router's program scheduling (PR #286, "Canonical request metadata"):
  `vllm_xargs.agentic_context`, an object with `program_id` (-> `conversation`),
  `expected_output_length` (-> `predicted`), `kv_retention_ttl_seconds` (-> `tool_s`: the
  seconds the client expects before the next turn) and `expected_resume` (false ->
  `retain: false`). vLLM's own request model refuses an object in `vllm_xargs`, so the
  object is taken out of the request once read.
- Continuum (michiLXY03/vllm-continuum-plugin, README "Request metadata"): `vllm_xargs.job_id`
  (-> `conversation`) and `vllm_xargs.is_last_step` (1 -> `retain: false`).

- Clients: OpenAI's `prompt_cache_key` (a top-level field of chat completions and Responses; Codex
  sends its conversation's id there) and the `X-Session-ID` header (-> `conversation`), below
  every `vllm_xargs` field (`client_fields`). An id the metadata would refuse (over
  MAX_CONVERSATION_CHARS characters, or with a `/`) becomes `key-` and a hash of it.

A request that sends none of these is still recognised as a conversation's turn, from its prompt,
in the engine core (`marsched.vllm.follow_ups`).

A field marsched's own object (`vllm_xargs.marsched`) already sets wins over its alias. A
malformed alias is an `AliasError` naming it; `marsched.vllm.metadata.parse` checks the merged
fields as it checks every request's.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from marsched.vllm.metadata import KEY, MAX_API_S, MAX_CONVERSATION_CHARS, MAX_TOKENS

ROUTER_KEY = "agentic_context"
CACHE_KEY = "prompt_cache_key"
SESSION_HEADER = b"x-session-id"


class AliasError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def own_fields(xargs: dict[str, Any]) -> dict[str, Any] | None:
    """The marsched object of `vllm_xargs` as a dict ({} when absent), or None when it is not a
    JSON string of an object, the only form vLLM's HTTP server takes (vLLM answers that request)."""
    raw = xargs.get(KEY)
    if raw is None:
        return {}
    if not isinstance(raw, str):
        return None
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return fields if isinstance(fields, dict) else None


def alias_fields(xargs: dict[str, Any]) -> dict[str, Any]:
    """The marsched fields the aliases in `xargs` give (raises AliasError)."""
    fields: dict[str, Any] = {}
    if "job_id" in xargs:
        fields["conversation"] = _program_id(xargs["job_id"], "vllm_xargs.job_id")
    if "is_last_step" in xargs:
        last = xargs["is_last_step"]
        if last not in (0, 1) or isinstance(last, float):
            raise AliasError("vllm_xargs.is_last_step", f"must be 0 or 1, got {last!r}")
        fields["retain"] = not last
    if ROUTER_KEY in xargs:
        fields.update(_router_fields(xargs[ROUTER_KEY]))
    return fields


def client_fields(body: dict[str, Any], headers: Any) -> dict[str, Any]:
    """The conversation a client's own id names: `prompt_cache_key`, else the `X-Session-ID` header."""
    key = body.get(CACHE_KEY)
    if not (isinstance(key, str) and key):
        key = next((v.decode("latin-1") for k, v in headers if k.lower() == SESSION_HEADER and v), None)
    return {"conversation": conversation_id(key)} if key else {}


def conversation_id(text: str) -> str:
    """`text` as a conversation id the metadata takes: itself if it can be, else `key-` and its hash."""
    if 1 <= len(text) <= MAX_CONVERSATION_CHARS and "/" not in text:
        return text
    return "key-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def merged_xargs(xargs: dict[str, Any], extra: dict[str, Any] | None = None,
                 clients: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """`xargs` with the fields of the clients' ids (`client_fields`), the aliases and `extra` (a
    prediction, a request id) in its marsched object, in that order under the fields it sets
    itself, and the router's object taken out; None if nothing changes or the marsched object is
    unreadable (raises AliasError)."""
    own = own_fields(xargs)
    aliases = alias_fields(xargs)
    if own is None or not (aliases or extra or clients or ROUTER_KEY in xargs):
        return None
    merged = {**(clients or {}), **aliases, **(extra or {}), **own}
    out = {k: v for k, v in xargs.items() if k != ROUTER_KEY}
    if merged:
        out[KEY] = json.dumps(merged, separators=(",", ":"))
    return out


def _router_fields(value: Any) -> dict[str, Any]:
    field = f"vllm_xargs.{ROUTER_KEY}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise AliasError(field, "must be an object or a JSON string of one") from None
    if not isinstance(value, dict):
        raise AliasError(field, f"must be an object, got {type(value).__name__}")
    fields: dict[str, Any] = {}
    if value.get("program_id") is not None:
        fields["conversation"] = _program_id(value["program_id"], f"{field}.program_id")
    length = value.get("expected_output_length")
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_TOKENS:
            raise AliasError(f"{field}.expected_output_length",
                             f"must be an integer from 1 to {MAX_TOKENS}, got {length!r}")
        fields["predicted"] = length
    ttl = value.get("kv_retention_ttl_seconds")
    if ttl is not None:
        number = isinstance(ttl, (int, float)) and not isinstance(ttl, bool)
        if not (number and math.isfinite(ttl) and 0 <= ttl <= MAX_API_S):
            raise AliasError(f"{field}.kv_retention_ttl_seconds",
                             f"must be seconds from 0 to {MAX_API_S:g}, got {ttl!r}")
        fields["tool_s"] = float(ttl)
    resume = value.get("expected_resume")
    if resume is not None:
        if not isinstance(resume, bool):
            raise AliasError(f"{field}.expected_resume", f"must be true or false, got {resume!r}")
        fields["retain"] = resume
    return fields


def _program_id(value: Any, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise AliasError(field, f"must be a string, got {type(value).__name__}")
    text = str(value)
    if not 1 <= len(text) <= MAX_CONVERSATION_CHARS:
        raise AliasError(field, f"must have 1 to {MAX_CONVERSATION_CHARS} characters, got {len(text)}")
    return text
