"""The preemption victim, one rule for both engines: the lowest-ranked running request that
is not protected by starvation prevention; the requester itself when every one is."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from marsched.policy.load import EngineLoad
from marsched.policy.policy import Policy
from marsched.policy.progress import RequestProgress

H = TypeVar("H")


def choose_victim(running: Iterable[H], requester: H, progress_of, policy: Policy, iteration: int,
                  load: EngineLoad) -> H:
    """The request to preempt so that `requester` can grow. `progress_of` maps a request to its
    `RequestProgress`; the highest `policy.victim_key` among unprotected ones is the lowest-ranked."""
    best, best_key = None, None
    for request in running:
        progress: RequestProgress = progress_of(request)
        if policy.is_protected(progress, iteration):
            continue
        key = policy.victim_key(progress, load)
        if best is None or key > best_key:
            best, best_key = request, key
    return requester if best is None else best
