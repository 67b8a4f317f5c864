"""Arrival processes: turn request templates into a timed stream."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from marsched.workload.model import Request


def poisson_arrivals(templates: Sequence[Request], qps: float, duration_s: float, seed: int) -> list[Request]:
    """A Poisson stream at `qps` requests/s over [0, duration_s), each arrival a template drawn with replacement.

    Gaps are exponential with mean 1/qps. Arrival n is template t under the id ``"{t's template id}#{n}"``
    (n counts from 0 in arrival order, so ids are unique). The same seed gives the same stream.
    """
    if not templates:
        raise ValueError("poisson_arrivals: no templates to sample from")
    for name, value in (("qps", qps), ("duration_s", duration_s)):
        if not _positive_finite(value):
            raise ValueError(f"poisson_arrivals: {name} must be a finite number > 0, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"poisson_arrivals: seed must be an integer, got {seed!r}")

    rng = np.random.default_rng(seed)
    times = _arrival_times(rng, float(qps), float(duration_s))
    picks = rng.integers(len(templates), size=len(times))
    return [
        templates[pick].arriving_at(float(time), f"{templates[pick].template_id or templates[pick].request_id}#{n}")
        for n, (time, pick) in enumerate(zip(times, picks))
    ]


def _arrival_times(rng: np.random.Generator, qps: float, duration_s: float, chunk: int | None = None) -> np.ndarray:
    # Draw gaps in chunks of about the expected count; chunk sizes depend only on the arguments, so a seed
    # still fixes the stream.
    chunk = chunk or max(64, math.ceil(qps * duration_s * 1.1))
    pieces: list[np.ndarray] = []
    now = 0.0
    while now < duration_s:
        times = now + np.cumsum(rng.exponential(1.0 / qps, size=chunk))
        pieces.append(times)
        now = float(times[-1])
    times = np.concatenate(pieces)
    return times[times < duration_s]


def _positive_finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
