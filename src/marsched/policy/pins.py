"""Which kept call gives its KV up first when memory runs short: the newest program's.

Continuum's queue serves pinned programs first, then programs by their first arrival
(`ContinuumRequestQueue` in its public code), so of the calls pinned on the device the newest
program's is worth least to that order. The simulator (`CallLifecycle.release_pinned`) and the
server (`ConversationKeeper.relieve`) both give pins up in this order: one rule, read in both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

Pin = TypeVar("Pin")


def release_order(pins: Iterable[Pin], program_arrival: Callable[[Pin], tuple[float, str]]) -> list[Pin]:
    """`pins` in the order they give way: the latest program arrival first; `program_arrival` gives
    a pin's (arrival, name), the name breaking ties (the larger first) so that the order is total."""
    return sorted(pins, key=program_arrival, reverse=True)
