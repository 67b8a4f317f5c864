"""γ-Boost: an order that bounds how far a request can be overtaken (`mars-boost`).

Yu & Scully (arXiv 2404.08826, "Strongly tail-optimal scheduling in the light-tailed M/G/1")
serve the smallest `a − b_γ(s)`, where `a` is the arrival and `s` the size in server time, with
the boost

    b_γ(s) = γ⁻¹ · ln(1 / (1 − e^{−γ·s})).

A small job gets a large boost and a large one almost none, so a request can only be passed by
requests that arrived less than `b_γ(s_min) − b_γ(s)` after it: overtaking is bounded, where a
promotion after a long wait lets it be passed without limit until it is rescued. γ → 0 ranks by
size alone (shortest first); a large γ is first come first served.

Here `a` is the request's original arrival (its program's, across calls and turns) and `s` its
MARS key (the predicted memory × time of its rest, token·s) over the device's KV capacity:
the seconds of the whole device its rest would take.
"""

from __future__ import annotations

import math

DEFAULT_BOOST_GAMMA = 0.01  # per second of device time, chosen by a sweep (docs/results.md, "Bounded overtaking")
SMALLEST_SIZE_S = 1e-9  # a size of 0 would get an infinite boost
LARGEST_EXPONENT = 700.0  # γ·s past this: e^{γs} − 1 overflows a float, and the boost is below 1e-300 s


def boost_s(size_s: float, gamma: float) -> float:
    """b_γ(s), in seconds: how much earlier than its arrival a request of size `size_s` ranks."""
    if not gamma > 0:
        raise ValueError(f"boost γ must be > 0, got {gamma}")
    exponent = gamma * max(size_s, SMALLEST_SIZE_S)
    return -math.log(-math.expm1(-exponent)) / gamma


def excess_exponent(size_s: float, gamma: float) -> float:
    """γ·s, kept where e^{γs} − 1 is a positive float."""
    return min(gamma * max(size_s, SMALLEST_SIZE_S), LARGEST_EXPONENT)


def boost_from_excess(excess: float, gamma: float) -> float:
    """The boost of a size known only through its label ℓ (Yu & Scully's prediction form),
    γ⁻¹·ln(M_ℓ / (M_ℓ − 1)), from `excess` = M_ℓ − 1 = E[e^{γS} − 1 | ℓ] (> 0). A size known
    exactly has excess e^{γs} − 1, and this is b_γ(s)."""
    return math.log1p(1.0 / excess) / gamma


def boost_key(arrival_s: float, size_s: float, gamma: float) -> float:
    """The Boost rank: lower runs first."""
    return arrival_s - boost_s(size_s, gamma)
