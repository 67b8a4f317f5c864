"""The waiting queue as the trace shows it: who waits, since when, in which lane, and each
request's starvation count in the declared clock.

Rebuilt from events alone, so that the order and starvation checks compare what the engine
reported (`score`, `promoted`, `counter`) with what its own events imply. The counting rule
is `marsched.policy.queue.WaitingQueue`'s, read from the trace's declaration: a request's
counter is the time it spent in the queue (iterations or seconds) since it arrived or was
last promoted, carried across preemptions and calls (and, for a later turn of a program, from
its arrival's `carried`); under `requeued` only stays after it
first ran count; a promotion resets the counter unless it is for life, and a request
promoted for life goes to the promoted lane at every later stay.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from marsched.audit.declared import Starvation
from marsched.audit.reader import Line
from marsched.policy.policy import StarvationClock, StarvationCount


@dataclass(slots=True, eq=False)
class Waiting:
    rid: str
    entered: Line
    since: float  # the clock reading at which its count started (entry less what it carried in)
    counted: bool
    promoted: bool = False
    promoted_at: Line | None = None
    lane_rank: tuple[float, int] = (0.0, 0)  # order in the promoted lane


class QueueModel:
    def __init__(self, starvation: Starvation) -> None:
        self.starvation = starvation
        self.seconds = starvation.clock is StarvationClock.SECONDS
        self.waiting: dict[str, Waiting] = {}
        self.promoted: dict[str, Waiting] = {}
        self.arrival: dict[str, float] = {}
        self.requeued_t: dict[str, float] = {}  # the last time a call's return put it back in the queue
        self.carried: dict[str, float] = {}
        self.ran_before: set[str] = set()
        self.elder: set[str] = set()  # promoted for life
        self._sequence = itertools.count()
        self._by_start: list[tuple[float, int, Waiting]] = []  # counted, unpromoted entries by count start
        self._lane: list[tuple[tuple[float, int], Waiting]] = []  # the promoted lane (stale entries skipped)

    def clock(self, event: dict) -> float:
        return event["t"] if self.seconds else event["iteration"]

    def counter(self, waiting: Waiting, event: dict) -> float:
        return self.clock(event) - waiting.since

    def apply(self, line: Line) -> None:
        e = line.event
        kind = e["event"]
        if kind == "arrive":
            # Its place in the arrival order: a later turn of a program over HTTP takes its program's.
            self.arrival[e["rid"]] = e.get("program_arrival_s", e["arrival_s"])
            if e.get("carried"):  # a later turn of a program: its program's wait so far
                self.carried[e["rid"]] = float(e["carried"])
            if e.get("elder"):  # a later turn of a program promoted for life: in the promoted lane
                self.elder.add(e["rid"])
            self._enter(line)
        elif kind == "preempt":
            self._enter(line)
        elif kind == "resume" and e["where"] != "device":
            self.requeued_t[e["rid"]] = e["t"]
            self._enter(line)
        elif kind == "admit":
            self._leave(line)
        elif kind == "promote":
            self._promote(line)
        elif kind == "finish":
            waiting = self.waiting.pop(e["rid"], None)
            if waiting is not None:
                self.promoted.pop(e["rid"], None)

    def _enter(self, line: Line) -> None:
        e = line.event
        rid = e["rid"]
        if rid in self.waiting:
            return  # entered twice: the lifecycle and order checks say so
        counted = self.starvation.enabled and (
            self.starvation.counts is StarvationCount.ALL_WAITING or rid in self.ran_before)
        waiting = Waiting(rid, line, self.clock(e) - self.carried.get(rid, 0.0), counted)
        self.waiting[rid] = waiting
        if rid in self.elder:
            self._to_lane(waiting, line)
        elif counted:
            heapq.heappush(self._by_start, (waiting.since, next(self._sequence), waiting))

    def _leave(self, line: Line) -> None:
        e = line.event
        rid = e["rid"]
        waiting = self.waiting.pop(rid, None)
        self.promoted.pop(rid, None)
        self.ran_before.add(rid)
        if waiting is not None and waiting.counted:
            self.carried[rid] = self.clock(e) - waiting.since

    def _promote(self, line: Line) -> None:
        e = line.event
        waiting = self.waiting.get(e["rid"])
        if waiting is None or waiting.promoted:
            return
        if self.starvation.for_life:
            self.elder.add(e["rid"])
        else:
            waiting.since = self.clock(e)  # the counter resets at promotion
        self._to_lane(waiting, line)

    def _to_lane(self, waiting: Waiting, line: Line) -> None:
        waiting.promoted = True
        waiting.promoted_at = line
        # Promoted requests go in promotion order, or by arrival when promotion is for life.
        first = self.arrival.get(waiting.rid, 0.0) if self.starvation.for_life else 0.0
        waiting.lane_rank = (first, next(self._sequence))
        self.promoted[waiting.rid] = waiting
        heapq.heappush(self._lane, (waiting.lane_rank, waiting))

    def first_promoted(self) -> Waiting | None:
        while self._lane and self.promoted.get(self._lane[0][1].rid) is not self._lane[0][1]:
            heapq.heappop(self._lane)
        return self._lane[0][1] if self._lane else None

    def overdue(self, event: dict, threshold: float, slack: float) -> list[Waiting]:
        """Counted, unpromoted requests past the threshold that waited since before this iteration
        (each once). Promotion runs at the start of an iteration: one that re-enters the queue
        later in it (a preemption) with its counter past the threshold is promoted at the next."""
        found, later = [], []
        clock = self.clock(event)
        while self._by_start:
            since, _, waiting = self._by_start[0]
            if self.waiting.get(waiting.rid) is not waiting or waiting.promoted or waiting.since != since:
                heapq.heappop(self._by_start)
                continue
            if clock - since < threshold + slack:
                break
            entry = heapq.heappop(self._by_start)
            (later if waiting.entered.event["iteration"] >= event["iteration"] else found).append(entry)
        for entry in later:
            heapq.heappush(self._by_start, entry)
        return [waiting for _, _, waiting in found]
