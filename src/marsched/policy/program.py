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
from dataclasses import dataclass, field

PRIOR_TURNS_LEFT = 1.0  # turns left of a program while too few have ended to say
PRIOR_WEIGHT = 4.0  # programs' worth of weight the prior has
MAX_ENDED = 10_000  # ended programs remembered (the oldest forgotten first)


@dataclass(frozen=True, slots=True)
class ProgramOutlook:
    turns_left: float  # expected turns after this one
    output_tokens: float  # a turn's reply
    growth_tokens: float  # context a turn adds (its reply and the tool's result)


def rest_area_per_iteration(outlook: ProgramOutlook, context_tokens: int) -> float:
    """The rest of the program's KV token-iterations: its memory × time per second of τ."""
    n, o, g = outlook.turns_left, outlook.output_tokens, outlook.growth_tokens
    if n <= 0 or o <= 0:
        return 0.0
    return o * (n * (context_tokens + o / 2) + g * n * (n + 1) / 2)


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
    _order: list[int] = field(default_factory=list)

    def ended(self, turns: int) -> None:
        bisect.insort(self._sorted, turns)
        self._order.append(turns)
        if len(self._order) > self.limit:
            oldest = self._order.pop(0)
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]

    def turns_left(self, turns_so_far: int) -> float:
        return expected_turns_left(self._sorted, turns_so_far)

    def __len__(self) -> int:
        return len(self._sorted)
