"""Reading an ASGI request's body in a middleware and handing it on unchanged."""

from __future__ import annotations

from typing import Any

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")  # the OpenAI endpoints that generate
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API (Codex)
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (Claude Code)
GENERATE_PATHS = COMPLETION_PATHS + (RESPONSES_PATH, MESSAGES_PATH)  # every endpoint vLLM serves that generates


async def read_body(receive: Any) -> bytes | None:
    """The whole body, or None if the client left before it arrived."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replay_body(raw: bytes, receive: Any) -> Any:
    """A receive that gives the body read already, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def post_body(app: Any, scope: dict[str, Any], receive: Any, send: Any, paths: tuple[str, ...]) -> bytes | None:
    """The whole body of a POST to one of `paths`. None when there is nothing more for the middleware
    to do: the request is not such a POST (it has been passed to `app` as it came), or the client
    left before its body arrived."""
    if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in paths:
        await app(scope, receive, send)
        return None
    return await read_body(receive)
