"""Ranking keys: the predicted memory × time of a request's remaining life (MARS), and remaining tokens (SJF).

MARS area of what is left of a request, in token·seconds, summed over the current and
later segments; each term can be switched off for ablations (`RankingTerms`):

- prefill: tokens still to be prefilled (a new prompt, a recompute, an API return),
  held at the full context for Tfwd(prefill): (Tfwd(X) + e·X·(P − X))·P. Tfwd(X) is the
  paper's, as from an empty cache; the second term is the attention the X new tokens pay
  over the P − X tokens already cached (`CostModel.cached_attention_time`), which decides
  what an API return on a long context costs. The context reads of those cached tokens
  (b·(P − X) per chunk) stay out, as before the attention term, so that the paper's
  profiles (e = 0) rank as they did.
- decode: decoding L̂ tokens from context P at τ seconds per iteration holds
  τ·(L̂·P + L̂(L̂+1)/2).
- call: the segment's call under its strategy, C = P + L̂ at the call:
  Preserve C·T̂, Discard the recompute area Tfwd(C)·C, Swap 2·Tswap(C)·C. A call that
  compacts the context to K tokens (`compaction.py`) brings back only K: Discard
  Tfwd(K)·K, Swap Tswap(C)·C + Tswap(K)·K.
- after_call: the later segments, each from its predicted context (the previous context
  at the call, or the prefix a compaction keeps, + predicted return), with prefill of what
  is not cached after the call (the return and the last token sampled before it; after a
  compaction, the return), decode and call terms as above and the strategy the same waste
  rule would pick for it.

τ is the engine's current iteration time. A running request's remaining decode is
max(L̂ − generated, 1): an under-predicted segment is taken as nearly done.

Only the decode terms depend on τ, linearly, so a key is a line in τ (`KeyForm`): the
waiting queue keeps each request's line and re-evaluates it when τ moves, instead of
rebuilding the outlook (a few µs per request, thousands of requests per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from marsched.policy.cost_model import CostModel
from marsched.policy.strategy import Strategy
from marsched.policy.waste import CallCosts
from marsched.predict.segment import SegmentPrediction


@dataclass(frozen=True, slots=True)
class RankingTerms:
    prefill: bool = True
    decode: bool = True
    call: bool = True
    after_call: bool = True


def decode_weight(context_tokens: int, decode_tokens: int) -> float:
    """`decode_area` per second of iteration time (token·iterations)."""
    n = max(decode_tokens, 0)
    return n * context_tokens + n * (n + 1) / 2


def decode_area(context_tokens: int, decode_tokens: int, iteration_s: float) -> float:
    return iteration_s * decode_weight(context_tokens, decode_tokens)


def call_area(strategy: Strategy, context_at_call: int, api_s: float, cost: CostModel,
              kept_tokens: int | None = None) -> float:
    return call_area_of(CallCosts.of(context_at_call, api_s, cost, kept_tokens), strategy)


def call_area_of(call: CallCosts, strategy: Strategy) -> float:
    """`call_area` from a call's costs: Preserve C·T̂, Discard Tfwd(K)·K, Swap Tswap(C)·C + Tswap(K)·K
    (Swap's waste)."""
    if strategy is Strategy.PRESERVE:
        return call.context_tokens * call.api_s
    if strategy is Strategy.DISCARD:
        return call.recompute_s * call.kept_tokens
    return call.swap


def prefill_area(context_tokens: int, prefill_tokens: int, cost: CostModel,
                 recompute_time: Callable[[int], float] | None = None) -> float:
    cached = context_tokens - prefill_tokens
    recompute_s = (recompute_time or cost.recompute_time)(prefill_tokens)
    return (recompute_s + cost.cached_attention_time(prefill_tokens, cached)) * context_tokens


@dataclass(slots=True)  # not frozen: built per later segment at every push
class SegmentOutlook:
    """What is left of one segment, as the ranking sees it."""

    context_tokens: int  # context now (current segment) or predicted at its start (later ones)
    prefill_tokens: int
    decode_tokens: int
    prediction: SegmentPrediction
    strategy: Strategy | None
    call: CallCosts | None = None  # its call's costs, where the outlook priced the call already


@dataclass(slots=True)  # not frozen: built at every push
class KeyForm:
    """A ranking key as a line in the iteration time τ: `per_iteration_s · τ + fixed`.

    `follows_running_kv`: the key also depends on the running batch's KV (a later call's
    strategy is chosen by the waste rule, which weighs the batch). It is the same line for
    every batch KV in `[running_kv_from, running_kv_below)`, where the later calls' strategies
    are the same (`waste.discard_cheapest_below`); outside that range it must be recomputed.
    """

    per_iteration_s: float
    fixed: float
    follows_running_kv: bool = False
    running_kv_from: float = 0
    running_kv_below: float = math.inf

    def holds_for(self, running_kv_tokens: int) -> bool:
        """Whether this line is the key at a running batch of `running_kv_tokens` KV tokens."""
        return not self.follows_running_kv or self.running_kv_from <= running_kv_tokens < self.running_kv_below

    def at(self, iteration_s: float) -> float:
        # The one place a key's value is computed: pushes and refreshes agree to the bit.
        if not self.per_iteration_s:
            return self.fixed
        return self.per_iteration_s * iteration_s + self.fixed


def remaining_area_form(outlook: list[SegmentOutlook], cost: CostModel, terms: RankingTerms,
                        follows_running_kv: bool = False,
                        running_kv: tuple[float, float] = (0, math.inf),
                        recompute_time: Callable[[int], float] | None = None) -> KeyForm:
    """`remaining_area` as a line in τ: the decode terms' weight, and the rest. `recompute_time`:
    `cost.recompute_time`, or a memo of it."""
    per_iteration_s = 0.0
    fixed = 0.0
    for index, segment in enumerate(outlook):
        if index > 0 and not terms.after_call:
            break
        if terms.prefill and segment.prefill_tokens:
            fixed += prefill_area(segment.context_tokens, segment.prefill_tokens, cost, recompute_time)
        if terms.decode:
            per_iteration_s += decode_weight(segment.context_tokens, segment.decode_tokens)
        if terms.call and segment.prediction.has_call and segment.strategy is not None:
            call = segment.call
            if call is None:
                call = CallCosts.of(segment.context_tokens + segment.decode_tokens, segment.prediction.api_duration_s,
                                    cost, segment.prediction.kept_tokens, recompute_time)
            fixed += call_area_of(call, segment.strategy)
    return KeyForm(per_iteration_s, fixed, follows_running_kv, *running_kv)


def remaining_area(outlook: list[SegmentOutlook], iteration_s: float, cost: CostModel, terms: RankingTerms) -> float:
    return remaining_area_form(outlook, cost, terms).at(iteration_s)
