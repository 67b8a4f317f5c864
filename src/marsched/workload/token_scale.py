"""Token scaling: a request's shape with every length × a factor, to fit long contexts into small engines.

`scale_tokens(request, factor)` multiplies the contexts, outputs and call returns and rounds
to whole tokens. Contexts are scaled where they stand (each segment's start, each
compaction's kept prefix), not rebuilt from scaled increments, so that rounding does not
add up over a conversation of a hundred calls; a call's return is what separates one scaled
context from the next. A length that is not 0 stays at least 1 token (a segment that
generates keeps generating), and so are the prompt tokens a task shares with the task before it.
Durations, arrival, ids, ties to a parent and conversations are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import replace

from marsched.workload.model import ApiCall, Request, build_request


def check_token_scale(factor: object) -> float:
    """The factor as a float, or ValueError: it must be a finite number > 0."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"token scale must be a finite number > 0, got {factor!r}")
    return float(factor)


def scaled_length(tokens: int, factor: float) -> int:
    """`tokens` × `factor`, rounded, and at least 1 unless `tokens` is 0."""
    return max(1, round(tokens * factor)) if tokens else 0


def scale_tokens(request: Request, factor: float) -> Request:
    """The request with its lengths × `factor` (see the module docstring); itself when `factor` is 1."""
    factor = check_token_scale(factor)
    if factor == 1:
        return request
    segments = request.segments
    targets = [scaled_length(s.context_tokens, factor) for s in segments]
    context = targets[0]  # the scaled context as built; a target below what a call keeps is not reached
    parts: list[tuple[int, ApiCall | None]] = []
    for index, segment in enumerate(segments):
        output = scaled_length(segment.output_tokens, factor)
        api = segment.api
        at_call = context + output
        if api is not None and index == len(segments) - 1:  # a trailing call: its return is never computed
            api = replace(api, return_tokens=scaled_length(api.return_tokens, factor))
        elif api is not None:
            kept = None if api.kept_tokens is None else min(scaled_length(api.kept_tokens, factor), at_call)
            base = at_call if kept is None else kept
            api = replace(api, kept_tokens=kept, return_tokens=max(targets[index + 1] - base, 0))
            context = base + api.return_tokens
        parts.append((output, api))
    scaled = build_request(request.request_id, targets[0], parts, request.arrival_s)
    follows = request.follows
    if follows is not None:
        follows = replace(follows, shared_tokens=min(scaled_length(follows.shared_tokens, factor), targets[0]))
    return replace(scaled, template_id=request.template_id, spawned_by=request.spawned_by,
                   conversation=request.conversation, follows=follows)
