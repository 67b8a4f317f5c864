"""Session arrivals: conversations replayed task by task, each task coming its human's gap after
the task before it ends (a closed loop per conversation), as users of an agent send them.

Conversations start as a Poisson process at `sessions_per_s` over [0, `horizon_s`), each one of
the templates' conversations drawn at random. A conversation's first task arrives at its start;
each later task (`Request.follows`) arrives when its previous task has ended on the engine that
ran it, plus the human's gap, so its arrival is known only in the run: the stream holds it back
(`SessionStream.follow_up`) and the cluster simulator (`sim/cluster.py`) lets it in. No task
arrives at or after `horizon_s`: the run then drains.

A run that starts empty would hold mostly first tasks for hours: in the bundled claude-code file
a conversation spans 3.2 h on average from its first call to its last, and up to 82 h. So the run
starts where a process that began long ago would be: the conversations in progress at time 0 are
drawn as such a process leaves them (their number Poisson with mean `sessions_per_s` × the mean
span, each conversation drawn in proportion to its span, at an age uniform over it), and each
comes in with its next task at that task's start in the recorded conversation (a template's
`arrival_s`). Their earlier tasks never ran, so nothing of their contexts is cached anywhere at
first; a warm-up before the measured window lets the caches fill.

Instance n of a conversation's task has the id ``"{template id}#{n}"`` and the conversation
``"{template conversation}#{n}"``, so that two instances of one recorded conversation share
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from marsched.workload.arrivals import arrive_with_children, poisson_times, spawned_children, template_key
from marsched.workload.model import Request


@dataclass(slots=True)
class SessionStream:
    """The tasks whose arrival is known (`starts`, in time order, with the requests they start) and
    those held until their previous task ends (by that task's id: the task, then the requests it
    starts, their `arrival_s` counted from the task's)."""

    starts: list[Request]
    held: dict[str, list[Request]] = field(default_factory=dict)
    horizon_s: float = math.inf
    sessions: int = 0  # conversations in the stream, those in progress at 0 included

    def follow_up(self, previous_id: str, ended_s: float, not_before_s: float = 0.0) -> list[Request]:
        """The next task of `previous_id`'s conversation, which ended at `ended_s`, and the requests
        it starts, timed (no earlier than `not_before_s`); none if there is no next task or it
        would come at or after the horizon."""
        group = self.held.pop(previous_id, None)
        if not group:
            return []
        arrival_s = max(ended_s + group[0].follows.gap_s, not_before_s)
        if arrival_s >= self.horizon_s:
            return []
        return [replace(request, arrival_s=arrival_s + request.arrival_s) for request in group]


def conversations(templates: Sequence[Request]) -> list[list[Request]]:
    """The templates' conversations: each a first task (one that follows none and is started by
    none) and the tasks that follow it, in order."""
    roots = [t for t in templates if t.spawned_by is None]
    next_of = {t.follows.previous_id: t for t in roots if t.follows is not None}
    chains = []
    for first in (t for t in roots if t.follows is None):
        chain = [first]
        while template_key(chain[-1]) in next_of:
            chain.append(next_of.pop(template_key(chain[-1])))
        chains.append(chain)
    if next_of:
        orphan = next(iter(next_of.values()))
        raise ValueError(f"session arrivals: template {template_key(orphan)!r} follows "
                         f"{orphan.follows.previous_id!r}, which is not a task among the templates")
    return chains


def session_arrivals(templates: Sequence[Request], sessions_per_s: float, horizon_s: float,
                     seed: int) -> SessionStream:
    """Conversations of `templates` started at `sessions_per_s` over [0, `horizon_s`), with those in
    progress at 0 (module docstring). The same seed gives the same stream."""
    for name, value in (("sessions_per_s", sessions_per_s), ("horizon_s", horizon_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"session arrivals: {name} must be a finite number > 0, got {value!r}")
    chains = conversations(templates)
    if not chains:
        raise ValueError("session arrivals: no template starts a conversation")
    children = spawned_children(templates)
    by_key = {template_key(t): t for t in templates}
    rng = np.random.default_rng(seed)
    spans = np.array([chain[-1].arrival_s for chain in chains], dtype=float)
    stream = SessionStream([], horizon_s=float(horizon_s))
    n = 0
    if spans.sum() > 0:  # in progress at 0: next task k at its start less the age
        count = int(rng.poisson(sessions_per_s * spans.mean()))
        for pick, age in zip(rng.choice(len(chains), size=count, p=spans / spans.sum()), rng.random(count)):
            chain = chains[pick]
            age_s = float(age * spans[pick])
            k = next(i for i, task in enumerate(chain) if task.arrival_s > age_s)
            _add(stream, chain, k, float(chain[k].arrival_s) - age_s, n, children, by_key)
            n += 1
    times = poisson_times(rng, float(sessions_per_s), float(horizon_s))
    for time, pick in zip(times, rng.integers(len(chains), size=len(times))):
        _add(stream, chains[pick], 0, float(time), n, children, by_key)
        n += 1
    stream.starts.sort(key=lambda r: r.arrival_s)  # stable: a task before the requests it starts
    stream.sessions = n
    return stream


def _add(stream: SessionStream, chain: list[Request], first: int, arrival_s: float, n: int,
         children: dict[str, list[Request]], by_key: dict[str, Request]) -> None:
    """Instance `n` of `chain` from task `first` on: that task arrives at `arrival_s`, the later
    ones are held, each with the requests it starts timed from it."""
    if arrival_s >= stream.horizon_s:
        return
    for k in range(first, len(chain)):
        group: list[Request] = []
        arrive_with_children(chain[k], arrival_s if k == first else 0.0, n, None, children, group)
        group = [_in_conversation(r, n, by_key, runs_previous=r is not group[0] or k > first) for r in group]
        if k == first:
            stream.starts.extend(group)
        else:
            stream.held[group[0].follows.previous_id] = group


def _in_conversation(request: Request, n: int, by_key: dict[str, Request], runs_previous: bool) -> Request:
    """Instance n's `request` in instance n's conversation, following instance n's previous task
    if that runs (`runs_previous`; a conversation in progress at 0 starts past its earlier tasks)."""
    template = by_key[request.template_id]
    follows = template.follows
    if follows is not None:
        follows = replace(follows, previous_id=f"{follows.previous_id}#{n}") if runs_previous else None
    conversation = f"{template.conversation}#{n}" if template.conversation else ""
    return replace(request, conversation=conversation, follows=follows)
