"""Device memory wasted during an API call, per strategy, in token·seconds.

These are INFERCEPT's definitions (ICML 2024, Section 4), with C the context at the
call, T the call's duration and K the KV tokens of the rest of the running batch:

- Preserve: C·T. The context sits idle on the device for the whole call.
- Discard: Tfwd(C)·(C + K). Recomputing C tokens takes Tfwd(C) (`CostModel.recompute_time`:
  budget-sized chunks from an empty cache, their attention pairs `e·C(C+1)/2` included, which
  make a long context's recompute grow with its square); the request's own memory and the
  batch's are held while the batch makes room for the recompute.
- Swap: 2·Tswap(C)·C. Our engines move swaps over the host link in budgets that fit
  under an iteration's compute, so the batch does not stall (the K term of the
  INFERCEPT formula, which charges the non-overlapped transfer, is zero); what is
  lost is the request's own device memory, held while it is copied out and while
  it is copied back before it can run.

A call that compacts the context (`kept_tokens`, see `compaction.py`) brings back only the
kept prefix K: Discard recomputes K, `Tfwd(K)·(K + batch)`, and Swap copies C out and K back,
`Tswap(C)·C + Tswap(K)·K`. Without compaction K = C and the formulas are the ones above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from marsched.policy.compaction import kept_context
from marsched.policy.cost_model import CostModel
from marsched.policy.strategy import Strategy


def preserve_waste(context_tokens: int, api_s: float) -> float:
    return context_tokens * max(api_s, 0.0)


def discard_waste(context_tokens: int, batch_kv_tokens: int, cost: CostModel, kept_tokens: int | None = None) -> float:
    kept = kept_context(context_tokens, kept_tokens)
    return recompute_waste(cost.recompute_time(kept), kept, batch_kv_tokens)


def recompute_waste(recompute_s: float, kept_tokens: int, batch_kv_tokens: int) -> float:
    """Discard's waste from its Tfwd(K): the request's K tokens and the batch's, held for it."""
    return recompute_s * (kept_tokens + batch_kv_tokens)


def swap_waste(context_tokens: int, cost: CostModel, kept_tokens: int | None = None) -> float:
    kept = kept_context(context_tokens, kept_tokens)
    return cost.swap_time(context_tokens) * context_tokens + cost.swap_time(kept) * kept


@dataclass(frozen=True, slots=True)
class Wastes:
    preserve: float
    discard: float
    swap: float

    def of(self, strategy: Strategy) -> float:
        if strategy is Strategy.PRESERVE:
            return self.preserve
        return self.discard if strategy is Strategy.DISCARD else self.swap


def call_wastes(context_tokens: int, api_s: float, batch_kv_tokens: int, cost: CostModel,
                kept_tokens: int | None = None) -> Wastes:
    return Wastes(
        preserve_waste(context_tokens, api_s),
        discard_waste(context_tokens, batch_kv_tokens, cost, kept_tokens),
        swap_waste(context_tokens, cost, kept_tokens),
    )


def cheapest(wastes: Wastes, swap_allowed: bool = True) -> Strategy:
    return cheapest_of(wastes.preserve, wastes.discard, wastes.swap, swap_allowed)


def cheapest_of(preserve: float, discard: float, swap: float, swap_allowed: bool = True) -> Strategy:
    """The strategy of least waste. Ties go to the one that moves the least data: Preserve, then
    Swap, then Discard."""
    best, least = Strategy.PRESERVE, preserve
    if swap_allowed and swap < least:
        best, least = Strategy.SWAP, swap
    return Strategy.DISCARD if discard < least else best


@dataclass(slots=True)  # not frozen: built per later call at every push
class CallCosts:
    """One call's wastes with its Tfwd(K) evaluated once: the choice at any running batch, the
    batch below which it is Discard, and (`ranking.call_area_of`) its term in a ranking key.

    A MARS key prices every later call of a request and is rebuilt at each push to the queue;
    each value here is built with the expression the functions above use, so it is theirs to the bit.
    """

    context_tokens: int  # C, the context at the call
    api_s: float  # T
    kept_tokens: int  # K: what the next segment keeps (C without compaction)
    recompute_s: float  # Tfwd(K)
    preserve: float
    swap: float

    @classmethod
    def of(cls, context_tokens: int, api_s: float, cost: CostModel, kept_tokens: int | None = None,
           recompute_time: Callable[[int], float] | None = None) -> "CallCosts":
        """`recompute_time`: `cost.recompute_time`, or a memo of it."""
        kept = kept_context(context_tokens, kept_tokens)
        recompute_s = (recompute_time or cost.recompute_time)(kept)
        return cls(context_tokens, api_s, kept, recompute_s, preserve_waste(context_tokens, api_s),
                   swap_waste(context_tokens, cost, kept_tokens))

    def discard(self, batch_kv_tokens: int) -> float:
        """Discard's waste at a running batch of `batch_kv_tokens`."""
        return recompute_waste(self.recompute_s, self.kept_tokens, batch_kv_tokens)

    def wastes(self, batch_kv_tokens: int) -> Wastes:
        return Wastes(self.preserve, self.discard(batch_kv_tokens), self.swap)

    def cheapest(self, batch_kv_tokens: int) -> Strategy:
        """`cheapest(call_wastes(...))` with swap allowed."""
        return cheapest_of(self.preserve, self.discard(batch_kv_tokens), self.swap)

    def discard_cheapest_below(self) -> float:
        """The batch KV `b` below which `cheapest` is Discard: Discard exactly when the batch
        holds fewer than `b` tokens (0: never; inf: always).

        Only Discard's waste grows with the batch, and it grows monotonically even in floating
        point, so the choice changes once; `b` is found with the very expression Discard's waste
        evaluates, so that it agrees with `cheapest` to the bit (a ranking key that depends on the
        batch is valid for the range of batches that gives the same choices: `ranking.KeyForm`).
        """
        bound = min(self.preserve, self.swap)  # Discard is last on ties: it must be strictly below both

        def discards(batch: int) -> bool:
            return self.discard(batch) < bound

        if not discards(0):
            return 0
        per_token = self.recompute_s
        estimate = bound / per_token - self.kept_tokens if per_token > 0 else math.inf
        if not math.isfinite(estimate):
            return math.inf
        return first_false(discards, math.ceil(estimate))


def discard_cheapest_below(context_tokens: int, api_s: float, cost: CostModel, kept_tokens: int | None = None) -> float:
    """`CallCosts.discard_cheapest_below` of one call."""
    return CallCosts.of(context_tokens, api_s, cost, kept_tokens).discard_cheapest_below()


def first_false(holds: Callable[[int], bool], guess: int) -> int:
    """The least n >= 1 where `holds` is false, for `holds` true at 0 and true then false as n
    grows, searched from `guess` (a guess from real arithmetic, which rounding may put a step off)."""
    n = max(guess, 1)
    while n > 1 and not holds(n - 1):
        n -= 1
    while holds(n):
        n += 1
    return n
