"""Getting marsched's marks in vLLM's abort messages to the right data-parallel rank.

Two kinds of ids ride in the abort path besides request ids: conversation releases
(`retention.RELEASE_PREFIX`) and stop-string ends (`stop_strings.STOPPED_PREFIX`). With one
engine core every id reaches it. vLLM's data-parallel client (`DPLBAsyncMPClient`) sends each
id to the rank it placed that request on (`reqs_in_flight`) and drops the ids it did not
place, ours among them. So a release goes to every rank, and a stop-string end goes with
its request, in the same message, to the request's rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_ROUTED = "_marsched_routes_stop_marks"


def engines_of(core: Any) -> list[Any]:
    """The engine cores a data-parallel client places requests on; [] for any other client."""
    if not hasattr(core, "reqs_in_flight"):
        return []
    return list(getattr(core, "core_engines", ()) or ())


async def send_to_every_rank(core: Any, request_ids: list[str]) -> None:
    engines = engines_of(core)
    if not engines:
        await core.abort_requests_async(request_ids)
        return
    for engine in engines:
        await core._abort_requests(list(request_ids), engine)


def route_marks_with_their_requests(core: Any, prefix: str) -> bool:
    """Make a data-parallel client send each `prefix + request id` in the abort message of that
    request, to its rank (once per client; True if it was done now). Other clients are left alone."""
    if len(engines_of(core)) < 2 or getattr(core, _ROUTED, False):
        return False
    abort = core.abort_requests_async

    async def routed(request_ids: list[str]) -> None:
        if not any(rid.startswith(prefix) for rid in request_ids) or core.resources.engine_dead:
            await abort(request_ids)
            return
        by_engine: defaultdict[Any, list[str]] = defaultdict(list)
        for rid in request_ids:
            engine = core.reqs_in_flight.get(rid[len(prefix):] if rid.startswith(prefix) else rid)
            if engine is not None:
                by_engine[engine].append(rid)
        for engine, ids in by_engine.items():
            await core._abort_requests(ids, engine)

    core.abort_requests_async = routed
    setattr(core, _ROUTED, True)
    return True
