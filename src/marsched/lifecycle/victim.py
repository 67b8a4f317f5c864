"""The preemption victim, one rule for both engines: the lowest-ranked running request that
is not protected by starvation prevention; the requester itself when every one is."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

H = TypeVar("H")


def choose_victim(running: Iterable[H], requester: H, is_protected: Callable[[H], bool],
                  victim_key: Callable[[H], float]) -> H:
    """The request to preempt so that `requester` can grow: the highest `victim_key` (the policy's
    `victim_key`: the lowest-ranked) among the unprotected; the first such on a tie."""
    best, best_key = None, None
    for request in running:
        if is_protected(request):
            continue
        key = victim_key(request)
        if best is None or key > best_key:
            best, best_key = request, key
    return requester if best is None else best
