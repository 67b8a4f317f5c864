"""A trace as spans and counters: what `marsched plot` draws and `marsched export` writes.

Each request's life is a sequence of spans in one state each (waiting, running, in a call
by strategy, swapping out or in, swapped out and queued); the engine's counters are the
queue lengths and the KV blocks in use, as step functions over time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from marsched.audit.reader import read_events


class State(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    CALL_PRESERVE = "call: preserve"
    CALL_DISCARD = "call: discard"
    CALL_SWAP = "call: swap"
    CALL_TRAILING = "call: trailing"  # the last segment's call; the KV is freed
    SWAP_OUT = "swapping out"
    SWAP_IN = "swapping in"
    SWAPPED = "swapped, queued"


_CALL = {"preserve": State.CALL_PRESERVE, "discard": State.CALL_DISCARD, "swap": State.SWAP_OUT,
         None: State.CALL_TRAILING}
QUEUES = ("waiting", "running", "paused", "swapped")  # the counters' queues


@dataclass(frozen=True, slots=True)
class Span:
    rid: str
    state: State
    start: float
    end: float
    segment: int


@dataclass(slots=True)
class Timeline:
    engine: str
    policy: str
    device_blocks: int
    host_blocks: int
    start: float
    end: float
    spans: list[Span] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # in arrival order
    times: list[float] = field(default_factory=list)  # counter samples: after each event that changes one
    queues: dict[str, list[int]] = field(default_factory=lambda: {q: [] for q in QUEUES})
    kv_device: list[int] = field(default_factory=list)
    kv_host: list[int] = field(default_factory=list)


def _next_state(event: dict, current: State | None) -> State | None:
    """The state after a request event, or None to keep the current one."""
    kind = event["event"]
    if kind == "api_start":
        return _CALL.get(event["strategy"], State.CALL_TRAILING)
    if kind == "swap_out":
        return State.CALL_SWAP
    if kind == "admit" and current is State.SWAPPED:
        return State.SWAP_IN
    if kind == "swap_in":
        return State.RUNNING
    if kind == "resume":
        return {"device": State.RUNNING, "waiting": State.WAITING, "host": State.SWAPPED}[event["where"]]
    if kind == "assign_strategy" and current in (State.CALL_PRESERVE, State.CALL_DISCARD, State.SWAP_OUT,
                                                 State.CALL_SWAP):
        return _CALL[event["strategy"]]  # INFERCEPT reconsidering a preserved call
    return {"arrive": State.WAITING, "admit": State.RUNNING, "preempt": State.WAITING}.get(kind)


def build_timeline(path: str | os.PathLike[str]) -> Timeline:
    lines = read_events(path)
    run = next(lines).event
    timeline = Timeline(run["engine"], run["policy"]["name"], run["device_blocks"], run["host_blocks"],
                        run["t"], run["t"])
    current: dict[str, tuple[State, float, int]] = {}
    queue_of: dict[str, str] = {}
    counts = dict.fromkeys(QUEUES, 0)

    def sample(t: float, event: dict) -> None:
        if timeline.times and timeline.times[-1] == t:  # keep the last value at each time
            for q in QUEUES:
                timeline.queues[q][-1] = counts[q]
            timeline.kv_device[-1], timeline.kv_host[-1] = event["kv_device_blocks"], event["kv_host_blocks"]
            return
        timeline.times.append(t)
        for q in QUEUES:
            timeline.queues[q].append(counts[q])
        timeline.kv_device.append(event["kv_device_blocks"])
        timeline.kv_host.append(event["kv_host_blocks"])

    for line in lines:
        event = line.event
        t = event["t"]
        timeline.end = max(timeline.end, t)
        rid = event.get("rid")
        if rid is not None and "queue" in event:
            if event["event"] == "arrive":
                timeline.requests.append(rid)
            queue = event["queue"]
            before = queue_of.get(rid)
            if queue != before:
                if before in counts:
                    counts[before] -= 1
                if queue in counts:
                    counts[queue] += 1
                queue_of[rid] = queue
            state, since, segment = current.get(rid, (None, t, 0))
            new = State.RUNNING if queue == "finished" else _next_state(event, state)
            if event["event"] == "finish" or (new is not None and new is not state):
                if state is not None and t > since:
                    timeline.spans.append(Span(rid, state, since, t, segment))
                if event["event"] == "finish":
                    current.pop(rid, None)
                else:
                    current[rid] = (new, t, event["segment"])
        sample(t, event)
    for rid, (state, since, segment) in current.items():  # a trace cut short: show what was open
        timeline.spans.append(Span(rid, state, since, timeline.end, segment))
    return timeline
