"""Memory-aware admission: admit a request only if the predicted peak of device KV still fits.

A request admitted into a full engine does not fail at once: the batch grows by one token
per request per iteration until memory runs out, and then a running request is
preempted and recomputed from scratch. Under memory pressure that churn is where the
time goes. With output-length predictions the engine can see it coming: each running
request holds `tokens` now, grows by one per iteration for `decode_left` more iterations,
and then either keeps its KV (a preserved call) or frees it (a finish, a discard, a swap).
The total over the coming iterations is piecewise linear, so its peak is at one of the
moments a request stops growing; admission checks that peak against the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Admission(str, Enum):
    GREEDY = "greedy"  # admit whatever fits now; preempt when growth runs out of memory (vLLM, INFERCEPT)
    PREDICTED_PEAK = "predicted-peak"  # admit only if the predicted peak of the batch fits


@dataclass(slots=True)  # not frozen: built per running request at each admission
class KvOutlook:
    """One request's device KV over its current segment, as predicted."""

    tokens: int  # KV tokens it holds once its pending tokens are computed
    decode_left: int  # iterations until its segment ends (>= 1)
    held_after: bool  # whether the KV stays on the device when the segment ends (a preserved call)


def predicted_peak_tokens(outlooks: list[KvOutlook], rounding_tokens: float = 0.0) -> float:
    """The largest total KV the requests will hold at once over their current segments.

    At `t` iterations from now a request holds `tokens + t` while `t <= decode_left`, then
    `tokens + decode_left` if `held_after`, else nothing. The sum is checked at each
    `t = decode_left` (the only local maxima). `rounding_tokens` is added per request
    holding KV at that moment, for the partly filled last block. O(n log n).
    """
    if not outlooks:
        return 0.0
    ordered = sorted(outlooks, key=lambda o: o.decode_left)
    n = len(ordered)
    suffix_tokens = [0] * (n + 1)  # sum of `tokens` over ordered[i:]
    for i in range(n - 1, -1, -1):
        suffix_tokens[i] = suffix_tokens[i + 1] + ordered[i].tokens
    peak = 0.0
    held_tokens, held_count = 0, 0  # requests already past their segment end that keep their KV
    i = 0
    while i < n:
        t = ordered[i].decode_left
        growing = n - i
        total = suffix_tokens[i] + growing * t + held_tokens + (growing + held_count) * rounding_tokens
        peak = max(peak, total)
        while i < n and ordered[i].decode_left == t:  # past t, these stop growing
            if ordered[i].held_after:
                held_tokens += ordered[i].tokens + t
                held_count += 1
            i += 1
    return peak
