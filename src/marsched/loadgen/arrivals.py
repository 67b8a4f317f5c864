"""When sessions arrive: a Poisson process of sessions, drawn by the simulator's own arrival process.

`session_arrivals` hands the sessions to `marsched.workload.arrivals.poisson_arrivals` as
templates, so that the process is one piece of code: gaps exponential with mean 1/rate over
[0, duration), each arrival a session drawn with replacement, the same seed giving the same
stream. For claude-code these are the sessions, in the order, of ``marsched simulate --trace
claude-code --qps RATE --duration D --seed S``. Arrival n of session k is conversation
``k#n``.

A subagent's session comes with its parent's arrival, tied to the parent's conversation; it
starts when the parent's calling turn has ended (`marsched.loadgen.replay`), not at a time
of its own. One whose parent never reaches that turn (``--max-turns``) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from marsched.loadgen.session import Session
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.model import Request, Spawn, build_request


@dataclass(frozen=True, slots=True)
class Arrival:
    session: Session
    conversation: str  # unique per arrival: "<session key>#<n>"
    arrival_s: float  # since the start of the run; a subagent's: its parent's
    parent: str | None = None  # a subagent's: the parent's conversation
    parent_turn: int = 0  # a subagent's: it starts when this turn of the parent has ended


def _template(session: Session) -> Request:
    """A stand-in request: the arrival process reads only its id and its parent."""
    template = build_request(session.key, 1, [(1, None)])
    if session.parent is None:
        return template
    return replace(template, spawned_by=Spawn(session.parent, session.parent_turn))


def session_arrivals(sessions: Sequence[Session], rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """Sessions arriving at `rate` per second for `duration_s` seconds, in arrival order (a subagent's
    right after its parent's)."""
    by_key = {session.key: session for session in sessions}
    if len(by_key) != len(sessions):
        raise ValueError("session_arrivals: two sessions have the same key")
    arrivals: list[Arrival] = []
    kept: dict[str, Session] = {}  # conversation -> its session, for the subagents after it
    for request in poisson_arrivals([_template(s) for s in sessions], rate, duration_s, seed):
        session = by_key[request.template_id]
        spawn = request.spawned_by
        if spawn is None:
            arrivals.append(Arrival(session, request.request_id, request.arrival_s))
        elif spawn.parent_id in kept and spawn.segment_index < len(kept[spawn.parent_id].turns):
            arrivals.append(Arrival(session, request.request_id, request.arrival_s, spawn.parent_id,
                                    spawn.segment_index))
        else:
            continue
        kept[request.request_id] = session
    return arrivals
