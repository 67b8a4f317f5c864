"""`GET /marsched/state`: the MARS scheduler's state from a running `marsched serve`.

Loaded into vLLM's API server with `--middleware marsched.serve.state.MarsStateMiddleware`
(an ASGI middleware; vLLM's app keeps its engine client in `app.state.engine_client`).
It asks the workers' `MarsWorkerExtension.mars_state` (`collective_rpc`, through
`ask_ranks`, which `metrics.py` shares) and answers with its JSON: `host_bytes` (KV
the Swap connector holds in host memory), `swap_stats`, and under `scheduler`:
`device_total_blocks`, `device_free_blocks`, `device_usage`, `host_tokens`, `running`,
`waiting`, `paused` (and `paused_preserve|discard|swap`, by strategy), `tracked`,
`policy`, `iteration`, `promotions`, `retention` (the rule), and the conversations kept
between turns: `retained_preserve`, `retained_swap`, `retained_device_blocks`,
`retained_host_tokens`, `retention_hits`, `retention_misses`, `retention_expired`,
`retention_released`, `retention_reused_tokens`, `retention_redecided`, `retention_yielded`; the gap between a
conversation's turns as the scheduler predicts it: `tool_gaps` (tool name -> `samples`,
`estimate_s`) and `tool_gap_global_s` (`marsched.policy.retention.GapEstimator`).
When the API server predicts lengths, `prediction` says what that costs its requests
(`prediction_stats.py`: predictions made and failed, batches, the p50, p99 and longest wait in
milliseconds). `?request_id=ID` adds that request's predictions, strategies and status (`request`), and for
a conversation's finished turn the gap its retention was decided from (`request.retention`).
Under vLLM's data parallelism every rank answers: `{"data_parallel_size": N, "ranks": [...]}`,
one such state per rank, with its `rank`, and `affinity`, where this front end places
conversations (`affinity.py`).

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
            ranks = await ask_ranks(scope, request_id)
        except EngineUnavailable as error:
            await _answer(send, 503, {"error": str(error)})
            return
        prediction = _prediction()
        if len(ranks) == 1:
            await _answer(send, 200, {**_rank_state(ranks[0]), **prediction})
            return
        from marsched.serve.affinity import router_of

        router = router_of(scope)
        each = [{"rank": rank, **_rank_state(workers)} for rank, workers in enumerate(ranks)]
        await _answer(send, 200, {"data_parallel_size": len(ranks), "ranks": each,
                                  "affinity": router.state() if router is not None else None, **prediction})


def _prediction() -> dict[str, Any]:
    """The API server's prediction costs (`prediction_stats.py`), when it predicts."""
    from marsched.serve.prediction_stats import published

    stats = published()
    return {"prediction": stats.summary()} if stats is not None else {}


def _rank_state(workers: list[dict[str, Any]]) -> dict[str, Any]:
    return workers[0] if len(workers) == 1 else {"workers": workers}


class EngineUnavailable(Exception):
    """The engine is not ready, or did not answer within TIMEOUT_S."""


def rank_count(scope: dict[str, Any]) -> int:
    """The data-parallel ranks the app's engine client drives (1 without data parallelism)."""
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    return max(len(getattr(getattr(engine, "engine_core", None), "core_engines", ()) or ()), 1)


async def ask_ranks(scope: dict[str, Any], request_id: str | None = None,
                    timeout_s: float = TIMEOUT_S) -> list[list[dict[str, Any]]]:
    """Each data-parallel rank's workers' `mars_state` (one per tensor-parallel rank), in rank
    order, for any middleware of vLLM's app; one rank without data parallelism.

    vLLM's app keeps its engine client in `app.state.engine_client`; Starlette puts the app
    in `scope["app"]`. `AsyncLLM.collective_rpc` asks the first rank alone under data
    parallelism, so every rank's engine core is asked through vLLM's utility call to each
    (`call_utility_all_async`, in rank order). Raises EngineUnavailable with the reason.
    """
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if engine is None:
        raise EngineUnavailable("the engine is not ready")
    try:
        if rank_count(scope) > 1:
            asked = engine.engine_core.call_utility_all_async("collective_rpc", "mars_state", None, (request_id,), None)
            return [list(workers) for workers in await asyncio.wait_for(asked, timeout_s)]
        return [list(await asyncio.wait_for(engine.collective_rpc("mars_state", args=(request_id,)), timeout_s))]
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
    from marsched.serve.affinity import router_of

    router = router_of(scope)
    if router is not None:
        router.forget(conversation)
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
