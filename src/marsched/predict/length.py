"""Output-length predictors: how many tokens a segment generates before its call (or the end)."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Protocol

from marsched.workload.model import Request


class LengthPredictor(Protocol):
    name: str

    def predict(self, request: Request, segment_index: int) -> int: ...


@dataclass(frozen=True, slots=True)
class OracleLength:
    """The true length from the trace: the upper bound of what prediction can give."""

    name: str = "oracle"

    def predict(self, request: Request, segment_index: int) -> int:
        return request.segments[segment_index].output_tokens


@dataclass(frozen=True, slots=True)
class NoisyOracleLength:
    """The true length times (1 + e), e ~ Normal(0, sigma), at least 1 token.

    The error is drawn from a hash of (seed, request, segment), so every policy and
    every engine sees the same prediction for the same segment.
    """

    sigma: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"noisy predictor: sigma must be a finite number >= 0, got {self.sigma}")

    @property
    def name(self) -> str:
        return f"noisy:{self.sigma:g}"

    def predict(self, request: Request, segment_index: int) -> int:
        true_length = request.segments[segment_index].output_tokens
        digest = hashlib.blake2b(f"{self.seed}/{request.request_id}/{segment_index}".encode(), digest_size=8)
        error = random.Random(int.from_bytes(digest.digest(), "big")).gauss(0.0, self.sigma)
        return max(1, round(true_length * (1.0 + error)))


def parse_length_predictor(spec: str, seed: int = 0) -> LengthPredictor:
    """`oracle` or `noisy:SIGMA` (for example `noisy:0.3`)."""
    if spec == "oracle":
        return OracleLength()
    if spec.startswith("noisy:"):
        try:
            sigma = float(spec.removeprefix("noisy:"))
        except ValueError:
            raise ValueError(f"predictor {spec!r}: SIGMA in 'noisy:SIGMA' must be a number") from None
        return NoisyOracleLength(sigma, seed)
    raise ValueError(f"unknown predictor {spec!r}; valid: oracle, noisy:SIGMA (e.g. noisy:0.3)")
