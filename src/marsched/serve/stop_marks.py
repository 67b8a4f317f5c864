"""An ASGI middleware that, at the first request, makes the API server's stop-string ends known
to the scheduler as finishes (`marsched.vllm.stop_strings`): a conversation turn that a stop
string ended keeps its KV like any other finished turn.

vLLM's app keeps its engine client in `app.state.engine_client`; the marking is installed
before the first request reaches vLLM, so no stop string can end a request unmarked.
"""

from __future__ import annotations

from typing import Any


class StopStringMarksMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._marked = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._marked and scope.get("type") == "http":
            engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
            if engine is not None:
                from marsched.vllm.stop_strings import mark_stop_string_ends

                mark_stop_string_ends(engine)
                self._marked = True
        await self.app(scope, receive, send)
