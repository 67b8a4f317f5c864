"""Arrival processes: turn request templates into a timed stream."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from marsched.workload.model import Request, Spawn


def poisson_arrivals(templates: Sequence[Request], qps: float, duration_s: float, seed: int) -> list[Request]:
    """A Poisson stream at `qps` requests/s over [0, duration_s), each arrival a template drawn with replacement.

    Gaps are exponential with mean 1/qps. Arrival n is template t under the id ``"{t's template id}#{n}"``
    (n counts from 0 in arrival order, so ids are unique). The same seed gives the same stream.

    Templates that another one starts (`Request.spawned_by`, an agent's subagents) are not drawn
    themselves: they come with their parent's arrival n, under ``"{their template id}#{n}"``,
    `arrival_s` after it and tied to the parent's new id. The stream is in arrival order; a trace
    without such templates gives the same stream as before they existed.
    """
    if not templates:
        raise ValueError("poisson_arrivals: no templates to sample from")
    for name, value in (("qps", qps), ("duration_s", duration_s)):
        if not _positive_finite(value):
            raise ValueError(f"poisson_arrivals: {name} must be a finite number > 0, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"poisson_arrivals: seed must be an integer, got {seed!r}")

    roots = [t for t in templates if t.spawned_by is None]
    children = spawned_children(templates)
    if not roots:
        raise ValueError("poisson_arrivals: every template is started by another (spawned_by); none can arrive")
    rng = np.random.default_rng(seed)
    times = poisson_times(rng, float(qps), float(duration_s))
    picks = rng.integers(len(roots), size=len(times))
    stream: list[Request] = []
    for n, (time, pick) in enumerate(zip(times, picks)):
        arrive_with_children(roots[pick], float(time), n, None, children, stream)
    if children:
        stream.sort(key=lambda r: r.arrival_s)  # stable: a parent and its children stay in order on a tie
    return stream


def template_key(template: Request) -> str:
    return template.template_id or template.request_id


def spawned_children(templates: Sequence[Request]) -> dict[str, list[Request]]:
    """The templates each template starts, by the starting template's id."""
    known = {template_key(t) for t in templates}
    children: dict[str, list[Request]] = {}
    for template in templates:
        if template.spawned_by is not None:
            if template.spawned_by.parent_id not in known:
                raise ValueError(f"poisson_arrivals: template {template_key(template)!r} is started by "
                                 f"{template.spawned_by.parent_id!r}, which is not among the templates")
            children.setdefault(template.spawned_by.parent_id, []).append(template)
    return children


def arrive_with_children(template: Request, arrival_s: float, n: int, spawn: Spawn | None,
                         children: dict[str, list[Request]], stream: list[Request]) -> None:
    """Append arrival n of `template` at `arrival_s`, then the requests it starts (`children`),
    each under ``"{its template id}#{n}"`` and tied to its starter's new id."""
    request_id = f"{template_key(template)}#{n}"
    request = template.arriving_at(arrival_s, request_id)
    stream.append(replace(request, spawned_by=spawn) if spawn is not None else request)
    for child in children.get(template_key(template), ()):
        tie = Spawn(request_id, child.spawned_by.segment_index)
        arrive_with_children(child, arrival_s + child.arrival_s, n, tie, children, stream)


def poisson_times(rng: np.random.Generator, qps: float, duration_s: float, chunk: int | None = None) -> np.ndarray:
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
