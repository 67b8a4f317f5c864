"""Nudge-M: first come first served, except that an arriving small request may swap places with a
large one just ahead of it (`mars-nudge`).

Grosof, Yang, Scully & Harchol-Balter (SIGMETRICS 2021, "Nudge: Stochastically improving upon
FCFS") serve jobs in arrival order, except that a small job arriving to find a large job at the
back of the queue swaps places with it, unless that large job was swapped before. For light-tailed
sizes below saturation this beats FCFS at every percentile of the response time. Charlet & Van
Houdt (Operations Research 2024, "Tail optimality and performance analysis of the Nudge-M
scheduling algorithm") widen the back of the queue to the last M arrivals and show that a small,
finite M is the best of a large family of such rules.

Here a request's place is its original arrival (its program's, across calls and turns, as
mars-boost's `a`), or the place a swap gave it; its size is its MARS key (the predicted
memory × time of its rest) over the device's KV capacity, in device seconds, as mars-boost's.
Small and large are learnt online from the sizes of the requests that arrived before
(`SizeHistory`): below the lower tercile is small, above the upper one large. The rule is the
swap form of Nudge with Nudge-M's window: the arrival swaps with at most one large request,
the one nearest the back among the last M (the original Nudge's choice when M = 1, and the one
that moves the large request back the fewest places).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

# The last M waiting requests a small arrival may swap with. The papers keep M small: a large
# request is pushed back at most M places, once, so its tail barely moves, while with a third of
# arrivals large, 3 places hold an unswapped large one about 1 − (2/3)³ ≈ 70% of the time.
DEFAULT_NUDGE_M = 3
SIZES_KEPT = 1_000  # the recent sizes the bands are learnt from: they follow the load as τ moves
SIZES_BEFORE_BANDS = 30  # before this many sizes, nothing is small or large: plain FCFS


@dataclass(frozen=True, slots=True)
class SizeBands:
    """Which sizes are small and which large, in device seconds; between them is medium."""

    small_below_s: float  # a size strictly under this is small
    large_above_s: float  # a size strictly over this is large

    def is_small(self, size_s: float) -> bool:
        return size_s < self.small_below_s

    def is_large(self, size_s: float) -> bool:
        return size_s > self.large_above_s


@dataclass(frozen=True, slots=True)
class NudgeCandidate:
    """A waiting request near the back of the queue, as the nudge decision sees it."""

    size_s: float  # its size when it entered the queue, in device seconds
    nudged: bool  # it was swapped back once already: never again


def terciles(sorted_sizes: list[float]) -> SizeBands:
    """The bands from sizes in ascending order: the lower and upper terciles."""
    n = len(sorted_sizes)
    return SizeBands(sorted_sizes[n // 3], sorted_sizes[(2 * n) // 3])


def nudge_partner(arrival_size_s: float, back: Iterable[NudgeCandidate], bands: SizeBands | None,
                  window: int) -> int | None:
    """Which waiting request an arrival at the back of the queue swaps places with: its index in
    `back` (the waiting requests, nearest the back first), or None. Only a small arrival swaps,
    only with a large request never swapped before, and only among the last `window` (M)."""
    if window < 1:
        raise ValueError(f"the nudge window M must be >= 1, got {window}")
    if bands is None or not bands.is_small(arrival_size_s):
        return None
    for index, candidate in enumerate(islice(back, window)):
        if not candidate.nudged and bands.is_large(candidate.size_s):
            return index
    return None


class SizeHistory:
    """The sizes of the last `kept` arrivals, in arrival order and sorted, for the bands."""

    def __init__(self, kept: int = SIZES_KEPT, needed: int = SIZES_BEFORE_BANDS) -> None:
        if not 1 <= needed <= kept:
            raise ValueError(f"size history: need 1 <= sizes needed ({needed}) <= sizes kept ({kept})")
        self._kept = kept
        self._needed = needed
        self._arrived: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def bands(self) -> SizeBands | None:
        """The bands from the sizes seen so far; None (no request small or large) before enough."""
        return terciles(self._sorted) if len(self._sorted) >= self._needed else None

    def observe(self, size_s: float) -> None:
        self._arrived.append(size_s)
        bisect.insort(self._sorted, size_s)
        if len(self._arrived) > self._kept:
            oldest = self._arrived.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
