"""Synthetic multi-API requests: a mix of API types, each with ranges for its call and the text around it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from marsched.workload.model import ApiCall, ApiType, Request, build_request


def _check_count_range(name: str, bounds: tuple[int, int]) -> None:
    valid = (
        isinstance(bounds, (tuple, list))
        and len(bounds) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        and 0 <= bounds[0] <= bounds[1]
    )
    if not valid:
        raise ValueError(f"{name} must be integers 0 <= low <= high, got {bounds!r}")


@dataclass(frozen=True, slots=True)
class ApiTypeProfile:
    """Uniform ranges (inclusive) for one API type.

    `output_tokens` is what a segment generates before calling this API; `duration_s` and
    `return_tokens` describe the call.
    """

    api_type: ApiType
    duration_s: tuple[float, float]
    return_tokens: tuple[int, int]
    output_tokens: tuple[int, int]

    def __post_init__(self) -> None:
        low, high = self.duration_s
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
            raise ValueError(f"{self.api_type.value}: duration_s must be 0 <= low <= high, got {self.duration_s}")
        for name in ("return_tokens", "output_tokens"):
            _check_count_range(f"{self.api_type.value}: {name}", getattr(self, name))


# Observed minimum and maximum per type in the bundled trace (data/workloads/infercept_single_api.json),
# with types labelled as marsched.workload.infercept_json describes and text counted in GPT-2 tokens;
# durations rounded outward to four significant digits. The text types' pre-call outputs (5 to 117)
# are the trace's truncated completions.
DEFAULT_PROFILES: Mapping[ApiType, ApiTypeProfile] = MappingProxyType({
    p.api_type: p
    for p in (
        ApiTypeProfile(ApiType.MATH, duration_s=(0.0, 6.024e-4), return_tokens=(17, 45), output_tokens=(33, 518)),
        ApiTypeProfile(ApiType.VE, duration_s=(0.05159, 0.1109), return_tokens=(2, 2), output_tokens=(4, 4)),
        ApiTypeProfile(ApiType.QA, duration_s=(0.2751, 0.9940), return_tokens=(36, 81), output_tokens=(18, 714)),
        ApiTypeProfile(ApiType.CHATBOT, duration_s=(4.028, 60.0), return_tokens=(0, 1354), output_tokens=(5, 117)),
        ApiTypeProfile(ApiType.TTS, duration_s=(1.341, 12.12), return_tokens=(9, 9), output_tokens=(5, 117)),
        ApiTypeProfile(ApiType.IMAGE, duration_s=(9.396, 13.54), return_tokens=(8, 8), output_tokens=(5, 117)),
    )
})

# Token-count prompts in the bundled trace span 370 to 1973 tokens.
DEFAULT_PROMPT_TOKENS = (370, 1973)


def synthetic_requests(
    n: int,
    mix: Mapping[ApiType, float],
    *,
    seed: int,
    calls_per_request: tuple[int, int] = (1, 3),
    prompt_tokens: tuple[int, int] = DEFAULT_PROMPT_TOKENS,
    profiles: Mapping[ApiType, ApiTypeProfile] = DEFAULT_PROFILES,
) -> list[Request]:
    """`n` requests ``syn-0`` … ``syn-{n-1}``, all arriving at 0; the same seed gives the same requests.

    Each request draws a prompt length and a number of calls uniformly from their inclusive
    ranges; each call's type is drawn independently with probability proportional to `mix`,
    and its segment's output, duration and return from that type's profile. The final
    segment's output is drawn from the profile of the request's last call (a request with
    zero calls draws it from a type drawn from `mix`).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"synthetic_requests: n must be an integer >= 0, got {n!r}")
    _check_count_range("synthetic_requests: calls_per_request", calls_per_request)
    _check_count_range("synthetic_requests: prompt_tokens", prompt_tokens)
    types, weights = _mix_weights(mix, profiles)

    rng = np.random.default_rng(seed)
    requests = []
    for index in range(n):
        prompt = _integer(rng, prompt_tokens)
        calls = _integer(rng, calls_per_request)
        chosen = [types[i] for i in rng.choice(len(types), size=max(calls, 1), p=weights)]
        parts: list[tuple[int, ApiCall | None]] = []
        for api_type in chosen[:calls]:
            profile = profiles[api_type]
            output = _integer(rng, profile.output_tokens)
            duration = float(rng.uniform(*profile.duration_s))
            parts.append((output, ApiCall(api_type, duration, _integer(rng, profile.return_tokens))))
        parts.append((_integer(rng, profiles[chosen[-1]].output_tokens), None))
        requests.append(build_request(f"syn-{index}", prompt, parts))
    return requests


def _mix_weights(
    mix: Mapping[ApiType, float], profiles: Mapping[ApiType, ApiTypeProfile]
) -> tuple[list[ApiType], np.ndarray]:
    for api_type, weight in mix.items():
        if not isinstance(api_type, ApiType):
            raise ValueError(f"synthetic_requests: mix key {api_type!r} is not an ApiType")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"synthetic_requests: mix weight of {api_type.value} must be a finite number >= 0, got {weight!r}")
        if weight and api_type not in profiles:
            raise ValueError(f"synthetic_requests: no profile for API type {api_type.value}; pass one in `profiles`")
    types = [t for t, w in mix.items() if w > 0]
    if not types:
        raise ValueError("synthetic_requests: mix must give some API type a positive weight")
    weights = np.array([mix[t] for t in types], dtype=float)
    return types, weights / weights.sum()


def _integer(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1], endpoint=True))
