"""Reading an ASGI request's body in a middleware and handing it on unchanged."""

from __future__ import annotations

from typing import Any


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
