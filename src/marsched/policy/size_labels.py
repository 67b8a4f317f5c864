"""Boost's form for predicted sizes (`mars-boost-label`): a predicted size is worth what the
predictions with the same label turned out to be.

Yu & Scully (arXiv 2404.08826) give a job whose size is known only through a label ℓ the boost
b(ℓ) = γ⁻¹·ln(M_ℓ / (M_ℓ − 1)), M_ℓ = E[e^{γS} | ℓ] (`boost.boost_from_excess`). Here ℓ is the
length predictor's output for the request's current segment, in bands of powers of two, and S given
ℓ is the predicted size ŝ (MARS's key over the KV capacity, `boost.py`) times R, the ratio of a
segment's realized memory × time to its predicted one, drawn from the segments with that label that
ended. Where a label's predictions spread, M_ℓ > e^{γ·ŝ·E[R]} (Jensen), so the boost is smaller: a
request that may turn out large is not let far ahead on a small guess. Until a label has
`MIN_SAMPLES` ended segments, R = 1: the exact form.

R compares the current segment only (the later segments' and turns' share of ŝ is taken to be off
by as much). It is learnt from what a server sees end: a segment's prompt, its predicted and its
generated length.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from marsched.policy.boost import LARGEST_EXPONENT, excess_exponent

WINDOW = 256  # the newest ended segments kept per label
MIN_SAMPLES = 8  # ended segments a label needs before its spread is used


def label_of(predicted_tokens: int) -> int:
    """The band of a predicted length: k for [2^(k−1), 2^k) tokens."""
    return max(int(predicted_tokens), 1).bit_length()


def segment_area(context_tokens: int, output_tokens: int) -> float:
    """Token·iterations of a segment that generates `output_tokens` after `context_tokens`: its KV
    grows by one token a step."""
    return output_tokens * context_tokens + output_tokens * (output_tokens + 1) / 2


class SizeLabels:
    """The ratios R per label, learnt online; `excess` is E[e^{γ·ŝ·R} − 1 | ℓ]."""

    def __init__(self) -> None:
        self._ratios: dict[int, deque[float]] = {}
        self._arrays: dict[int, np.ndarray] = {}  # the ratios as an array, until the label learns more

    def observe(self, context_tokens: int, predicted_tokens: int, realized_tokens: int) -> None:
        """A segment ended: it was predicted at `predicted_tokens` and generated `realized_tokens`
        after a context of `context_tokens`."""
        predicted_area = segment_area(context_tokens, max(predicted_tokens, 1))
        label = label_of(predicted_tokens)
        self._ratios.setdefault(label, deque(maxlen=WINDOW)).append(
            segment_area(context_tokens, max(realized_tokens, 0)) / predicted_area)
        self._arrays.pop(label, None)

    def samples(self, predicted_tokens: int) -> int:
        return len(self._ratios.get(label_of(predicted_tokens), ()))

    def excess(self, size_s: float, predicted_tokens: int, gamma: float) -> float:
        """M_ℓ − 1 for a request of predicted size `size_s` (device seconds) whose current segment is
        predicted at `predicted_tokens`."""
        label = label_of(predicted_tokens)
        ratios = self._ratios.get(label, ())
        exponent = excess_exponent(size_s, gamma)
        if len(ratios) < MIN_SAMPLES:
            return float(np.expm1(exponent))
        array = self._arrays.get(label)
        if array is None:
            array = self._arrays[label] = np.fromiter(ratios, float, len(ratios))
        # A ratio of 0 (nothing generated) still leaves a size: the key's other terms.
        return float(np.expm1(np.clip(exponent * array, excess_exponent(0.0, gamma), LARGEST_EXPONENT)).mean())
