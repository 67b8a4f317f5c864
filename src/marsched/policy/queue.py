"""The ranked waiting queue with starvation prevention, shared by both engines.

Keys are cached at entry and recomputed every `refresh_interval` iterations for orders
that follow the engine's load (a heapify: O(n), not a sort). Between refreshes,
pushing and popping cost O(log n). A refresh does not rebuild each request's outlook:
a waiting request's progress does not change while it waits (engines change it before
they push it), so its key's line in τ (`KeyForm`), computed at the push, stays valid and
a refresh evaluates it at the new τ. Only lines that also follow the running batch's KV
(a later call's strategy chosen by waste) are recomputed in full, and only when the batch's
KV left the range over which those strategies stay the same (`KeyForm.holds_for`). The keys
are the same as a full recomputation's, to the bit.

Starvation counters are kept lazily: a request's counter is the time it has spent in the
queue since it arrived or was last promoted, across preemptions, in the policy's
starvation clock (iterations or engine seconds; `RequestProgress.waited_iterations` and
`waited_s` carry the count while it is out of the queue). Requests whose waiting does
not count (the `requeued` rule: fresh arrivals) have no counter. A heap ordered by the
moment each count started finds every request that reached the threshold in O(log n)
per promotion. A promoted request goes ahead of key order until it is scheduled: in
promotion order, or, when promotion is for life (the `age` rule), by arrival and at
every later stay in the queue too.

With a threshold relative to the first-come-first-served wait (`fcfs_multiple`), the
queue keeps that estimate (`fcfs_wait.py`): it registers each request at its first push,
and the engines tell it what they computed for each request (`served`) and when it ended
(`finished`). The threshold in force is the same for every waiting request, so the heap
by counter start still finds the due ones; `threshold` reports it for the event trace.

Under the Nudge order (`nudge.py`) a key is a place: the request's arrival, or the place a swap
gave it. The queue keeps the waiting requests sorted by place as well, so that a small request
entering at the back looks at the last M in O(M); a swap moves the large request to the back by
a fresh entry (its old heap slot is skipped, as a left request's is).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from marsched.policy.fcfs_wait import FcfsWait, predicted_work_tokens
from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.nudge import NudgeCandidate, SizeHistory, nudge_partner
from marsched.policy.policy import Order, Policy, StarvationClock
from marsched.policy.progress import KeyBasis, RequestProgress
from marsched.policy.ranking import KeyForm


# A count this close to the threshold is taken as there: with a seconds clock, float rounding
# could otherwise leave it a hair short while the engine waits a hair's time, forever.
_CLOCK_SLACK = 1e-9


@dataclass(slots=True, eq=False)
class _Entry:
    progress: RequestProgress
    form: KeyForm  # the key as a line in τ, from the progress at the push
    key: float
    load: EngineLoad  # the load `key` was evaluated at (the audit recomputes it from this)
    cost: CostModel  # the cost model `form` was computed with
    since: float  # when the starvation count started, in the policy's clock
    due: float  # `since`, plus how much longer than the threshold this request waits (per-service rules)
    counted: bool  # whether its waiting counts towards promotion
    promoted: bool = False
    live: bool = True
    size_s: float = math.nan  # the Nudge order's size at the push, in device seconds
    place_sequence: int = 0  # its tie-breaker in the Nudge order's list by place


@dataclass(slots=True)
class WaitingQueue:
    policy: Policy
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _heap: list[tuple[float, int, _Entry]] = field(default_factory=list)
    _promoted: list[tuple[float, int, _Entry]] = field(default_factory=list)  # heap: promotion order, or arrival
    _by_start: list[tuple[float, int, _Entry]] = field(default_factory=list)  # heap of (counter start, seq, entry)
    _sequence: int = 0
    _last_refresh: int = -1
    _refreshed_at_s: float | None = None  # the iteration time the keys were last computed with
    _popped: _Entry | None = None  # the entry `pop` returned last, for `push_back`
    _promoted_live: int = 0  # requests waiting in the promoted lane
    _fcfs: FcfsWait | None = None  # the FCFS wait estimate, when the threshold is relative to it
    _sizes: SizeHistory | None = None  # the Nudge order: the sizes of the arrivals so far
    _by_place: list[tuple[float, int, _Entry]] = field(default_factory=list)  # Nudge: waiting, by (place, sequence)

    def __post_init__(self) -> None:
        if self.policy.starvation.moves:
            self._fcfs = FcfsWait()
        if self.policy.order is Order.NUDGE:
            self._sizes = SizeHistory()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def _clock(self, iteration: int, now_s: float) -> float:
        return now_s if self.policy.starvation.clock is StarvationClock.SECONDS else iteration

    def push(self, progress: RequestProgress, load: EngineLoad, iteration: int) -> None:
        if progress.request_id in self._entries:
            raise ValueError(f"request {progress.request_id!r} is already waiting")
        if self._fcfs is not None and not self._fcfs.knows(progress.request_id):
            # What it will compute: a turn whose conversation's KV was kept brings only the rest of its prompt.
            work = predicted_work_tokens(max(progress.request.prompt_tokens - progress.computed_tokens, 0),
                                         progress.predictions, progress.program)
            self._fcfs.arrive(progress.request_id, load.now_s, work)
        counted = self.policy.starvation.counts_for(progress)
        since = self._clock(iteration, load.now_s) - self.policy.starvation.carried(progress)
        form = self.policy.queue_key_form(progress, load)
        due = since + self.policy.starvation.offset(progress) if counted else since
        entry = _Entry(progress, form, form.at(load.iteration_s), load, self.policy.cost, since, due, counted)
        swapped_back = self._nudge(entry, load) if self._sizes is not None else None
        self._enter(entry)
        if swapped_back is not None:  # after the arrival: at an equal place, the small one goes first
            self._enter(swapped_back)

    def _enter(self, entry: _Entry) -> None:
        self._entries[entry.progress.request_id] = entry
        if self._sizes is not None:
            self._add_place(entry)
        if entry.progress.elder:
            self._push_promoted(entry)  # promoted for life: ahead of the ranking at every stay
        else:
            self._push_heap(entry)
            if entry.counted:
                heapq.heappush(self._by_start, (entry.due, self._next_sequence(), entry))

    def push_back(self, progress: RequestProgress) -> None:
        """Return a request just popped and not scheduled to where it was (its counter keeps running)."""
        entry = self._popped
        if entry is None or entry.progress is not progress:
            raise ValueError("push_back takes back only the request popped last")
        self._popped = None
        entry.live = True
        self._entries[progress.request_id] = entry
        if self._sizes is not None:
            self._add_place(entry)
        progress.waited_iterations = 0
        progress.waited_s = 0.0
        if entry.promoted:
            self._push_promoted(entry, first=True)
        else:
            self._push_heap(entry)

    def pop(self, iteration: int, now_s: float) -> RequestProgress | None:
        """The next request in order (promoted first), removed from the queue."""
        entry = self._pop_promoted() or self._pop_heap()
        self._popped = entry
        if entry is None:
            return None
        self._leave(entry, iteration, now_s)
        progress = entry.progress
        progress.left_key = entry.key
        progress.left_promoted = entry.promoted
        # A waiting request's state does not change, so its key is the one `entry.load` gives it.
        progress.key_basis = KeyBasis(entry.load, progress.segment_index, progress.context_tokens,
                                      progress.computed_tokens, progress.generated, progress.strategy, entry.cost)
        return progress

    def remove(self, request_id: str, iteration: int, now_s: float) -> None:
        self._leave(self._entries[request_id], iteration, now_s)

    def _leave(self, entry: _Entry, iteration: int, now_s: float) -> None:
        entry.live = False
        del self._entries[entry.progress.request_id]
        if self._sizes is not None:
            self._drop_place(entry)
        if entry.promoted:
            self._promoted_live -= 1
        if not entry.counted:
            entry.progress.counter = 0.0
            return
        waited = self._clock(iteration, now_s) - entry.since
        entry.progress.counter = waited
        if self.policy.starvation.clock is StarvationClock.SECONDS:
            entry.progress.waited_s = waited
        else:
            entry.progress.waited_iterations = int(waited)

    def ordered(self) -> Iterator[RequestProgress]:
        """All waiting requests in order, without removing them (O(n log n): for tests and reports)."""
        promoted = [e.progress for _, _, e in sorted(self._promoted) if e.live]
        rest = sorted((k, s, e) for k, s, e in self._heap if e.live and not e.promoted)
        return iter(promoted + [e.progress for _, _, e in rest])

    def head_key(self) -> float | None:
        """The lowest key among waiting requests outside the promoted lane (None if there are none):
        what the event trace records so that an audit can see no better-ranked request was passed over."""
        while self._heap and not (self._heap[0][2].live and not self._heap[0][2].promoted):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    @property
    def promoted_waiting(self) -> int:
        return self._promoted_live

    # --- starvation -------------------------------------------------------------------

    def threshold(self, now_s: float) -> float | None:
        """The promotion threshold in force now (None: prevention off)."""
        config = self.policy.starvation
        if self._fcfs is None:
            return config.threshold
        return max(config.threshold, config.fcfs_multiple * self._fcfs.wait_s(now_s))

    @property
    def fcfs_wait(self) -> FcfsWait | None:
        """The FCFS wait estimate, when the threshold moves with it."""
        return self._fcfs

    def served(self, request_id: str, tokens: int) -> None:
        """The engine computed `tokens` for a request (the FCFS wait estimate's served work)."""
        if self._fcfs is not None:
            self._fcfs.served(request_id, tokens)

    def finished(self, request_id: str) -> None:
        """A request ended (the rest of its predicted work counts as served)."""
        if self._fcfs is not None:
            self._fcfs.finished(request_id)

    def starvation_counter(self, request_id: str, iteration: int, now_s: float) -> float:
        """The request's counter in the policy's starvation clock (0 if its waiting does not count)."""
        entry = self._entries[request_id]
        return self._clock(iteration, now_s) - entry.since if entry.counted else 0

    def promote_starving(self, iteration: int, now_s: float) -> list[RequestProgress]:
        """Promote every request whose counter reached the threshold; returns them."""
        threshold = self.threshold(now_s)
        promoted: list[RequestProgress] = []
        if threshold is None:
            return promoted
        clock = self._clock(iteration, now_s)
        while self._by_start:
            _, _, entry = self._by_start[0]
            if not entry.live or entry.promoted:
                heapq.heappop(self._by_start)
                continue
            if clock - entry.due < threshold - _CLOCK_SLACK:
                break
            heapq.heappop(self._by_start)
            entry.progress.counter = clock - entry.since
            entry.promoted = True
            entry.progress.promoted = True
            if self.policy.starvation.for_life:
                entry.progress.elder = True
            else:
                entry.since = clock  # the counter resets at promotion
            self._push_promoted(entry)
            promoted.append(entry.progress)
        return promoted

    def _next_start(self) -> float | None:
        while self._by_start and (not self._by_start[0][2].live or self._by_start[0][2].promoted):
            heapq.heappop(self._by_start)
        return self._by_start[0][0] if self._by_start else None

    def iterations_to_next_promotion(self, iteration: int) -> int | None:
        """For an iteration clock: iterations until the next promotion is due (>= 1), or None."""
        threshold = self.policy.starvation.threshold
        if threshold is None or self.policy.starvation.clock is not StarvationClock.ITERATIONS:
            return None
        start = self._next_start()
        if start is None:
            return None
        return max(math.ceil(start + threshold - iteration), 1)

    def seconds_to_next_promotion(self, now_s: float) -> float | None:
        """For a seconds clock: seconds until the next promotion is due (>= 0), or None."""
        threshold = self.threshold(now_s)
        if threshold is None or self.policy.starvation.clock is not StarvationClock.SECONDS:
            return None
        start = self._next_start()
        if start is None:
            return None
        return max(start + threshold - now_s, 0.0)

    # --- the Nudge order -------------------------------------------------------------

    def _nudge(self, entry: _Entry, load: EngineLoad) -> _Entry | None:
        """Nudge (`nudge.py`) for a request about to enter: its size is taken; at its first entry,
        if its place is at the back, it may swap places with a large request among the last M
        waiting. Returns that request's new entry (at the arrival's place), to enter after it."""
        progress = entry.progress
        entry.size_s = self.policy.device_size_s(progress, load)
        # Its first entry: not back from a call, a preemption or a skipped step, and (over HTTP)
        # not a later turn of a program that ran (those keep their program's place).
        arriving = not progress.queued_before and progress.attained_iterations == 0
        progress.queued_before = True
        if not arriving:
            return None
        swapped_back = None
        if not self._by_place or self._by_place[-1][0] <= entry.key:
            back = self._last_waiting(self.policy.nudge_m)
            partner = nudge_partner(entry.size_s, (NudgeCandidate(e.size_s, e.progress.nudged) for e in back),
                                    self._sizes.bands(), self.policy.nudge_m)
            if partner is not None:
                swapped_back = self._swap(entry, back[partner])
        self._sizes.observe(entry.size_s)  # after the decision: only earlier arrivals set the bands
        return swapped_back

    def _last_waiting(self, count: int) -> list[_Entry]:
        """The last `count` waiting requests by place, nearest the back first (promoted ones aside)."""
        back: list[_Entry] = []
        for _, _, entry in reversed(self._by_place):
            if len(back) == count:
                break
            if not entry.promoted:
                back.append(entry)
        return back

    def _swap(self, small: _Entry, large: _Entry) -> _Entry:
        """The small arrival takes the large request's place and the large one the arrival's; the
        large one is marked, so that it is swapped back at most once. Returns its new entry."""
        small_place, large_place = large.key, small.key
        # Places live in the progress: they hold across calls (and, over HTTP, the program's turns).
        small.progress.order_s, large.progress.order_s = small_place, large_place
        large.progress.nudged = True
        small.form, small.key = KeyForm(0.0, small_place), small_place
        self._leave_place_and_heap(large)
        return replace(large, form=KeyForm(0.0, large_place), key=large_place, live=True)

    def _leave_place_and_heap(self, entry: _Entry) -> None:
        """Take an entry out without leaving the queue (its heap slots are skipped from now)."""
        self._drop_place(entry)
        del self._entries[entry.progress.request_id]
        entry.live = False

    def _add_place(self, entry: _Entry) -> None:
        entry.place_sequence = self._next_sequence()
        bisect.insort(self._by_place, (entry.key, entry.place_sequence, entry))  # an arrival: an append

    def _drop_place(self, entry: _Entry) -> None:
        index = bisect.bisect_left(self._by_place, (entry.key, entry.place_sequence))
        if index == len(self._by_place) or self._by_place[index][2] is not entry:
            raise AssertionError(f"request {entry.progress.request_id!r} is not at its place in the nudge order")
        del self._by_place[index]

    # --- keys -------------------------------------------------------------------------

    def refresh(self, load: EngineLoad, iteration: int) -> bool:
        """Recompute keys if the order follows load, the interval has passed and the load moved
        beyond the policy's tolerance since the last refresh; True if it did."""
        if not self.policy.keys_follow_load or iteration - self._last_refresh < self.policy.refresh_interval:
            return False
        if self._refreshed_at_s is not None:
            change = abs(load.iteration_s - self._refreshed_at_s) / self._refreshed_at_s
            if change <= self.policy.refresh_tolerance:
                return False
        self._last_refresh = iteration
        self._refreshed_at_s = tau = load.iteration_s
        heap = []
        sequence = self._sequence
        for entry in self._entries.values():
            if not entry.promoted:
                form = entry.form
                # A form is redone when the load leaves its range, or the cost model changed (a server learns it).
                if entry.cost is not self.policy.cost or not form.holds_for(load.running_kv_tokens):
                    form = entry.form = self.policy.queue_key_form(entry.progress, load)
                    entry.cost = self.policy.cost
                entry.key = form.at(tau)
                entry.load = load
                sequence += 1
                heap.append((entry.key, sequence, entry))
        self._sequence = sequence
        heapq.heapify(heap)
        self._heap = heap
        return True

    def _push_heap(self, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.key, self._next_sequence(), entry))

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def _push_promoted(self, entry: _Entry, first: bool = False) -> None:
        """Promoted requests run in promotion order, or by arrival when promotion is for life."""
        entry.promoted = True
        self._promoted_live += 1
        if self.policy.starvation.for_life:
            rank = entry.progress.order_s
        else:
            rank = -math.inf if first else float(self._next_sequence())
        heapq.heappush(self._promoted, (rank, self._next_sequence(), entry))

    def _pop_promoted(self) -> _Entry | None:
        while self._promoted:
            _, _, entry = heapq.heappop(self._promoted)
            if entry.live:
                return entry
        return None

    def _pop_heap(self) -> _Entry | None:
        while self._heap:
            _, _, entry = heapq.heappop(self._heap)
            if entry.live and not entry.promoted:
                return entry
        return None

