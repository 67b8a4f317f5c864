"""Many probe clients at once for a while, and what they saw: `run_clients` and `summarize`."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any, Callable

from marsched.experiments.probe.actions import REQUEST_TIMEOUT_S, Outcome, Target, choose, run_action

PROGRESS_EVERY_S = 30.0
KEEPALIVE_S = 2.0


async def run_clients(target: Target, clients: int, duration_s: float, seed: int,
                      progress: Callable[[str], None] | None = None,
                      server_gone: Callable[[], bool] | None = None) -> list[Outcome]:
    """`clients` clients, each running actions back to back (`actions.choose`, its own seeded
    generator) until `duration_s` has passed, or until `server_gone()` says the server died (its
    refusals would be counted by the thousand); every outcome, in the order they ended."""
    import httpx

    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration_s
    # A connection idle past the server's keep-alive (uvicorn's 5 s, httpx's default too) may be
    # closed by the server just as the client sends on it: reused only while well inside it.
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients,
                          keepalive_expiry=KEEPALIVE_S)

    async def client_loop(index: int, client: Any) -> None:
        rng = random.Random(seed * 100_003 + index)
        while time.monotonic() < deadline and not (server_gone and server_gone()):
            outcomes.append(await run_action(client, target, choose(rng, target), rng))

    async def report() -> None:
        began = time.monotonic()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            faults = sum(o.fault is not None for o in outcomes)
            progress(f"{time.monotonic() - began:.0f} s: {len(outcomes)} actions, {faults} faults")

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        reporter = asyncio.create_task(report()) if progress else None
        try:
            await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
        finally:
            if reporter:
                reporter.cancel()
    return outcomes


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts by action and by status class, and the faults (the first 20 in full)."""
    statuses = Counter(_status_class(s) for o in outcomes for s in o.statuses)
    actions: dict[str, dict[str, int]] = {}
    for o in outcomes:
        row = actions.setdefault(o.action, {"runs": 0, "faults": 0})
        row["runs"] += 1
        row["faults"] += o.fault is not None
    faults = [f"{o.action}: {o.fault}" for o in outcomes if o.fault is not None]
    return {"actions_run": len(outcomes), "requests": sum(len(o.statuses) for o in outcomes),
            "statuses": dict(sorted(statuses.items())), "by_action": dict(sorted(actions.items())),
            "faults": len(faults), "first_faults": faults[:20]}


def _status_class(status: int) -> str:
    return "no answer" if status == 0 else f"{status // 100}xx"
