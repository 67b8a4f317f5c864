"""A program's predicted rest: the turns after this one, as the ranking key prices them.

Over HTTP a program (an agent's conversation) reaches the scheduler one turn at a time, each a
request of its own. MARS ranks a request by its predicted KV memory × time; for a turn it adds
the turns still to come, so that a program near its end goes before one with many turns left
(the shortest remaining program first, as MARS is the shortest remaining request first). A turn
`k` after this one holds about the context now plus `k` turns of growth, for the predicted reply
of `output_tokens` decode iterations:

    rest = τ · o · Σ_{k=1..n} (C + k·g + o/2) = τ · o · (n·(C + o/2) + g·n·(n+1)/2)

with `n` the expected turns left, `o` the reply length, `g` the context a turn adds and `C` the
context now. `n` is not an integer: it is the mean over the programs that ended of the turns they
had past this one (`ProgramLengths`), from a prior while few have ended.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

PRIOR_TURNS_LEFT = 1.0  # turns left of a program while too few have ended to say
PRIOR_WEIGHT = 4.0  # programs' worth of weight the prior has
MAX_ENDED = 10_000  # ended programs remembered (the oldest forgotten first)


@dataclass(frozen=True, slots=True)
class ProgramOutlook:
    """The rest of a program as its key prices it. With the conditional mean, `turns_left` is
    E[N] and the turns are priced as if exactly that many came. A Gittins outlook (`gittins.py`)
    prices the turns up to a horizon Δ: `turns_left` is E[min(N, Δ)], `turns_left_sq`
    E[min(N, Δ)²], and `completion` P(N ≤ Δ), the chance the program ends by then; the key is
    then the expected work to that horizon per unit of that chance."""

    turns_left: float  # expected turns after this one (to the horizon, for a Gittins outlook)
    output_tokens: float  # a turn's reply
    growth_tokens: float  # context a turn adds (its reply and the tool's result)
    turns_left_sq: float | None = None  # E[turns²] to the horizon; None: turns_left²
    completion: float = 1.0  # P(the program ends by the horizon); 1: the mean outlook

    def __post_init__(self) -> None:
        if not 0 < self.completion <= 1:
            raise ValueError(f"a program outlook's completion chance must be in (0, 1], got {self.completion}")


def rest_area_per_iteration(outlook: ProgramOutlook, context_tokens: int) -> float:
    """The rest of the program's KV token-iterations: its memory × time per second of τ.
    Linear in E[n] and E[n²], so the same formula prices a mean and a distribution."""
    n, o, g = outlook.turns_left, outlook.output_tokens, outlook.growth_tokens
    if n <= 0 or o <= 0:
        return 0.0
    n_sq = n * n if outlook.turns_left_sq is None else outlook.turns_left_sq
    return o * (n * (context_tokens + o / 2) + g * (n_sq + n) / 2)


def expected_turns_left(ended_turns: list[int], turns_so_far: int, prior: float = PRIOR_TURNS_LEFT,
                        prior_weight: float = PRIOR_WEIGHT) -> float:
    """Mean turns past `turns_so_far` of the ended programs that got that far (`ended_turns` sorted;
    one that ended there counts 0), pulled toward `prior` by `prior_weight` programs' worth."""
    longer = ended_turns[bisect.bisect_left(ended_turns, turns_so_far):]
    total = sum(t - turns_so_far for t in longer)
    return (total + prior * prior_weight) / (len(longer) + prior_weight)


@dataclass
class ProgramLengths:
    """The turn counts of the programs that ended, sorted, the latest `limit` of them."""

    limit: int = MAX_ENDED
    _sorted: list[int] = field(default_factory=list)
    _order: deque[int] = field(default_factory=deque)
    _counts: dict[int, int] = field(default_factory=dict)  # programs that ended, by their turns
    _left: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # turns_left_counts, until one ends

    def ended(self, turns: int) -> None:
        bisect.insort(self._sorted, turns)
        self._order.append(turns)
        self._counts[turns] = self._counts.get(turns, 0) + 1
        if len(self._order) > self.limit:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._counts[oldest] -= 1
            if not self._counts[oldest]:
                del self._counts[oldest]
        self._left.clear()

    def turns_left(self, turns_so_far: int) -> float:
        """`expected_turns_left` over the programs that ended, from their distinct turn counts (a
        few dozen) rather than from every program (up to `limit`): it is asked at every turn."""
        total = count = 0
        for turns, programs in self._counts.items():
            if turns >= turns_so_far:
                total += (turns - turns_so_far) * programs
                count += programs
        return (total + PRIOR_TURNS_LEFT * PRIOR_WEIGHT) / (count + PRIOR_WEIGHT)

    def turns_left_counts(self, turns_so_far: int) -> list[tuple[int, float]]:
        """The distribution of turns left past `turns_so_far`, as (turns, weight) sorted by turns:
        the ended programs that got that far, and the prior's weight at its turns
        (`PRIOR_TURNS_LEFT`, rounded)."""
        known = self._left.get(turns_so_far)
        if known is None:
            counts: dict[int, float] = {round(PRIOR_TURNS_LEFT): PRIOR_WEIGHT}
            for total, programs in self._counts.items():
                if total >= turns_so_far:
                    counts[total - turns_so_far] = counts.get(total - turns_so_far, 0.0) + programs
            known = self._left[turns_so_far] = sorted(counts.items())
        return known

    def __len__(self) -> int:
        return len(self._sorted)
