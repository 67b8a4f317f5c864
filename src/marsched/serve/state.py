"""`GET /marsched/state`: the MARS scheduler's state from a running `marsched serve`.

Loaded into vLLM's API server with `--middleware marsched.serve.state.MarsStateMiddleware`
(an ASGI middleware; vLLM's app keeps its engine client in `app.state.engine_client`).
It asks the workers' `MarsWorkerExtension.mars_state` (`collective_rpc`, through
`ask_workers`, which `metrics.py` shares) and answers with its JSON: `host_bytes` (KV
the Swap connector holds in host memory), `swap_stats`, and under `scheduler`:
`device_total_blocks`, `device_free_blocks`, `device_usage`, `host_tokens`, `running`,
`waiting`, `paused` (and `paused_preserve|discard|swap`, by strategy), `tracked`,
`policy`, `iteration`, `promotions`, `retention` (the rule), and the conversations kept
between turns: `retained_preserve`, `retained_swap`, `retained_device_blocks`,
`retained_host_tokens`, `retention_hits`, `retention_misses`, `retention_expired`,
`retention_released`, `retention_reused_tokens`.
`?request_id=ID` adds that request's predictions, strategies and status (`request`).

`DELETE /marsched/conversations/ID` frees what the server keeps of conversation ID
between its turns (`marsched.vllm.retention`), for a client that will not send the next
turn; it answers 202 at once and the scheduler frees it before its next step.

Unauthenticated, like vLLM's `/health` and `/metrics` (vLLM's `--api-key` guards `/v1`
and a few other prefixes only); `marsched serve --no-state-endpoint` leaves both out.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any
from urllib.parse import parse_qs

PATH = "/marsched/state"
CONVERSATIONS = "/marsched/conversations/"
TIMEOUT_S = 10.0


class MarsStateMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope.get("type") == "http" and path.startswith(CONVERSATIONS):
            await _release(scope, send, path[len(CONVERSATIONS):])
            return
        if scope.get("type") != "http" or path != PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("GET", "HEAD"):
            await _answer(send, 405, {"error": f"{PATH} answers GET only"}, {"allow": "GET"})
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        request_id = (query.get("request_id") or [None])[0]
        try:
            results = await ask_workers(scope, request_id)
        except EngineUnavailable as error:
            await _answer(send, 503, {"error": str(error)})
            return
        await _answer(send, 200, results[0] if len(results) == 1 else {"workers": results})


class EngineUnavailable(Exception):
    """The engine is not ready, or did not answer within TIMEOUT_S."""


async def ask_workers(scope: dict[str, Any], request_id: str | None = None,
                      timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """Every worker's `mars_state` (one per tensor-parallel rank), for any middleware of vLLM's app.

    vLLM's app keeps its engine client in `app.state.engine_client`; Starlette puts the app
    in `scope["app"]`. Raises EngineUnavailable with the reason.
    """
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if engine is None:
        raise EngineUnavailable("the engine is not ready")
    try:
        return list(await asyncio.wait_for(engine.collective_rpc("mars_state", args=(request_id,)), timeout_s))
    except Exception as error:  # noqa: BLE001 - a dead or busy engine is an answer, not a crash
        raise EngineUnavailable(f"engine did not answer: {type(error).__name__}: {error}") from error


async def _release(scope: dict[str, Any], send: Any, conversation: str) -> None:
    from marsched.vllm.metadata import MAX_CONVERSATION_CHARS
    from marsched.vllm.retention import send_release

    if scope.get("method") != "DELETE":
        await _answer(send, 405, {"error": f"{CONVERSATIONS}ID answers DELETE only"}, {"allow": "DELETE"})
        return
    if not 1 <= len(conversation) <= MAX_CONVERSATION_CHARS or "/" in conversation:
        await _answer(send, 400, {"error": f"conversation id: give 1 to {MAX_CONVERSATION_CHARS} characters, no '/'"})
        return
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if engine is None:
        await _answer(send, 503, {"error": "the engine is not ready"})
        return
    try:
        await asyncio.wait_for(send_release(engine, conversation), TIMEOUT_S)
    except Exception as error:  # noqa: BLE001
        await _answer(send, 503, {"error": f"engine did not answer: {type(error).__name__}: {error}"})
        return
    await _answer(send, 202, {"conversation": conversation, "release": "sent"})


async def _answer(send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(_finite(body), default=str, allow_nan=False).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _finite(value: Any) -> Any:
    """JSON has no NaN: a time not reached yet (NaN) is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
