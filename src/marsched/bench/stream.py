"""The requests a bench point replays, without vLLM: which ones, at what scale, with what token ids.

- **Arrivals**: `poisson_arrivals(templates, qps, duration, seed)` (the simulator's stream);
  `max_requests` keeps its first N.
- **Token scaling** (`scale_request`): every token count (prompt, each segment's output, each
  call's return) is multiplied by `token_scale` and rounded (outputs and the prompt at least
  1); a request whose final context still exceeds the engine's `max_model_len` is scaled
  again, as a whole, until it fits. So the shape of each request is kept, only smaller.
- **Tokens**: the prompt's token ids are drawn from a generator seeded by the request id
  (`prompt_token_ids`), as are each call's returned ids; ids avoid the special tokens 0-3.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from marsched.bench.options import check_nonnegative, check_positive
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.model import ApiCall, Request, build_request, scale_api_time

FIRST_ID = 4  # ids 0-3 are <unk>, <s>, </s>, <pad> in `marsched model`'s tokenizer


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def prompt_token_ids(request_id: str, count: int, vocab_size: int) -> list[int]:
    """`count` token ids in [4, vocab_size), the same for the same request id (any process, any run)."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocabulary of {vocab_size} ids has no room beyond the special ids 0-{FIRST_ID - 1}")
    return [int(t) for t in _rng(request_id).integers(FIRST_ID, vocab_size, size=max(count, 0))]


def return_token_ids(request_id: str, call_index: int, count: int, vocab_size: int) -> list[int]:
    """A call's returned ids: like `prompt_token_ids`, keyed by the request id and the call's index."""
    return prompt_token_ids(f"{request_id}/call{call_index}", count, vocab_size)


def _scaled(request: Request, factor: float) -> list[tuple[int, ApiCall | None]]:
    parts = []
    for segment in request.segments:
        api = segment.api
        if api is not None:
            api = ApiCall(api.api_type, api.duration_s, int(round(api.return_tokens * factor)))
        parts.append((max(1, int(round(segment.output_tokens * factor))), api))
    return parts


def _final_context(prompt: int, parts: list[tuple[int, ApiCall | None]]) -> int:
    """Tokens of the whole context at the end (a trailing call's return is never appended)."""
    total = prompt
    for index, (output, api) in enumerate(parts):
        total += output
        if api is not None and index < len(parts) - 1:
            total += api.return_tokens
    return total


def scale_request(request: Request, token_scale: float, max_context: int, api_time_scale: float = 1.0) -> Request:
    """The request as the bench runs it: token counts × `token_scale` (rounded; the prompt and each
    segment's output at least 1), shrunk further as a whole until the final context is at most
    `max_context`; API durations × `api_time_scale`. Raises ValueError if even one token per
    segment does not fit."""
    check_positive("--token-scale", token_scale)
    check_nonnegative("--api-time-scale", api_time_scale)
    factor = token_scale
    for _ in range(60):
        prompt = max(1, int(round(request.prompt_tokens * factor)))
        parts = _scaled(request, factor)
        final = _final_context(prompt, parts)
        if final <= max_context:
            break
        factor *= min(max_context / final, 0.98)
    else:
        raise ValueError(f"request {request.request_id!r}: its {len(request.segments)} segments do not fit in "
                         f"{max_context} tokens even at one token each; raise --max-model-len or --kv-cache-gb")
    scaled = build_request(request.request_id, prompt, parts, request.arrival_s)
    return replace(scale_api_time(scaled, api_time_scale), template_id=request.template_id)


def bench_requests(templates: list[Request], qps: float, duration_s: float, seed: int, token_scale: float,
                   max_context: int, api_time_scale: float, max_requests: int | None = None) -> list[Request]:
    """The seeded Poisson stream, first `max_requests` kept, each request scaled (`scale_request`)."""
    stream = poisson_arrivals(templates, qps, duration_s, seed)
    if max_requests is not None:
        stream = stream[:max_requests]
    return [scale_request(r, token_scale, max_context, api_time_scale) for r in stream]
