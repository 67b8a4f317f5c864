"""Output-length predictors: how many tokens a segment generates before its call (or the end)."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Protocol

from marsched.workload.model import Request


class LengthPredictor(Protocol):
    """`predict` gives a segment's output tokens. A predictor that needs the whole trace first
    (`type-mean`, `learned`) also has `prepare(templates, trace)`, which the engines call before a
    run (`prepare_length_predictor`)."""

    name: str

    def predict(self, request: Request, segment_index: int) -> int: ...


def prepare_length_predictor(predictor: LengthPredictor, templates: list[Request], trace: str | None) -> None:
    """Give a predictor that needs it the trace's requests (and its name or path, for its texts)."""
    prepare = getattr(predictor, "prepare", None)
    if prepare is not None:
        prepare(templates, trace)


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


# The bound: every segment's length, call and the segments still to come, read from the trace.
FOREKNOWLEDGE = "foreknowledge"
PREDICTOR_SPECS = ("online, foreknowledge (a bound), oracle, noisy:SIGMA (e.g. noisy:0.3), type-mean, learned, "
                   "learned:DIR, learned-online, learned-online:DIR")


def parse_length_predictor(spec: str, seed: int = 0) -> LengthPredictor:
    """`online`, `oracle`, `noisy:SIGMA` (for example `noisy:0.3`), `type-mean`, `learned`, `learned:DIR`,
    `learned-online` or `learned-online:DIR` (the head calibrated online, `marsched.predict.calibrated`).

    `type-mean` and `learned` need `prepare_length_predictor` before they predict
    (`marsched.predict.learned` says what they do). `learned` checks here that its head loads
    and that the encoder's package is installed.
    """
    if spec == "oracle":
        return OracleLength()
    if spec == FOREKNOWLEDGE:  # with the API oracle and the plan's later segments (`RunSpec.build`)
        return OracleLength(FOREKNOWLEDGE)
    if spec == "online":
        from marsched.predict.online import OnlineLength

        return OnlineLength()
    if spec == "type-mean":
        from marsched.predict.learned import TypeMeanLength

        return TypeMeanLength()
    if spec == "learned-online" or spec.startswith("learned-online:"):
        from marsched.predict.calibrated import CalibratedLength
        from marsched.predict.encoder import model_zip
        from marsched.predict.learned import head_directory

        head = spec.removeprefix("learned-online")
        calibrated = CalibratedLength(head_directory("learned" + head))
        model_zip()
        return calibrated
    if spec == "learned" or spec.startswith("learned:"):
        from marsched.predict.encoder import model_zip
        from marsched.predict.learned import LearnedLength, head_directory

        predictor = LearnedLength(head_directory(spec))
        model_zip()
        return predictor
    if spec.startswith("noisy:"):
        try:
            sigma = float(spec.removeprefix("noisy:"))
        except ValueError:
            raise ValueError(f"predictor {spec!r}: SIGMA in 'noisy:SIGMA' must be a number") from None
        return NoisyOracleLength(sigma, seed)
    raise ValueError(f"unknown predictor {spec!r}; valid: {PREDICTOR_SPECS}")
