"""N replicas of one engine profile behind a router: the simulated cluster.

Each replica is a simulator of its own (its own KV cache, queue and policy, the same profile and
policy name); they share nothing but the router. Arrivals are taken in time order: at each one,
every replica runs up to that time, and the routing rule picks one from their state then (a
replica's clock may be up to one iteration past it: the iteration running at the arrival ends
first, as on a real engine). The subagents a request's calls start run on its replica.

Routing rules (`Routing`):

- `round-robin`;
- `least-loaded`: vLLM's data-parallel balancer (`policy.placement.least_loaded_scores`), with a
  replica's in-flight count the requests it holds (running, waiting or in a call);
- `session-affine`: a hash of the conversation (vllm-project/router's `consistent_hash` on
  `X-Session-ID`); a claude-code task's conversation is the part of its id before `:`, and any
  other request is a conversation of its own;
- `mars`: the least predicted KV memory × time in flight (`policy.placement.mars_scores`), each
  request's MARS key from its own replica's policy (`MemoryTime`);
- `mars-affine`: a conversation seen before goes back to its replica unless that replica's
  memory × time is over `AFFINITY_BALANCE` × the replicas' mean (the shape of vllm-project/router's
  `cache_aware` balance rule), else as `mars`.

Arrivals are a list of requests (a Poisson draw: each task a conversation of its own, nothing
shared between requests) or a `SessionStream` (`workload/sessions.py`): conversations whose tasks
each come their human's gap after the task before ended. Then a task's KV blocks are its
conversation's content (`SimRequest.kv_owner`), and the next task takes back on its replica what
is still cached there, so routing decides what is reused. The replicas run in slices of
`SESSION_SLICE_S` between arrivals: a task that ended in a slice lets its follow-up in at the
slice's end at the earliest (at most that much late). Only tasks that arrive in the measured
window, and the requests they start, are counted; arrivals go on past the window until all of
those have ended (or the stream's horizon), and the run stops there.
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from marsched.policy.placement import RankLoad, hashed_rank, least_loaded_scores, lowest, mars_scores
from marsched.sim.request import SimResult
from marsched.sim.engine import Simulator
from marsched.workload.model import Request
from marsched.workload.sessions import SessionStream

AFFINITY_BALANCE = 1.5  # vllm-project/router's --balance-rel-threshold default
SESSION_SLICE_S = 0.5  # how often replicas running session arrivals report ended tasks


class Routing(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    SESSION_AFFINE = "session-affine"
    MARS = "mars"
    MARS_AFFINE = "mars-affine"


def parse_routing(value: str) -> Routing:
    try:
        return Routing(value)
    except ValueError:
        raise ValueError(f"--routing {value!r}: give one of {', '.join(r.value for r in Routing)}") from None


def conversation_of(request: Request) -> str:
    """The conversation a router keys on: the request's own (session arrivals), else its template's
    name before ``:`` (a claude-code task's recorded conversation), else its id."""
    if request.conversation:
        return request.conversation
    name = request.template_id or request.request_id
    return name.split(":", 1)[0]


class MemoryTime:
    """A replica's predicted memory × time in flight. Each request's key is priced at the start of
    its segment (a key of a request with many calls takes a fraction of a millisecond, and a
    replica holds hundreds, mostly in their tools) and read at the replica's current τ; a real
    replica's gauge is as coarse (recomputed every 0.5 s, `vllm/snapshot.py`)."""

    def __init__(self) -> None:
        self._forms: dict[str, tuple[int, object]] = {}  # request id -> (segment index, key form)

    def of(self, replica: Simulator) -> float:
        load = replica.load()
        total = 0.0
        for rid, sim_request in replica.live.items():
            progress = sim_request.progress
            if not progress.predictions:
                continue
            cached = self._forms.get(rid)
            if cached is None or cached[0] != progress.segment_index:
                cached = (progress.segment_index, replica.policy.memory_time_form(progress, load))
                self._forms[rid] = cached
            total += cached[1].at(load.iteration_s)
        if len(self._forms) > 2 * len(replica.live) + 64:  # the ended ones
            self._forms = {rid: form for rid, form in self._forms.items() if rid in replica.live}
        return total


def replica_load(replica: Simulator, memory_time: MemoryTime | None = None) -> RankLoad:
    return RankLoad(memory_time=memory_time.of(replica) if memory_time else 0.0, tracked=len(replica.live),
                    waiting=len(replica.queue), running=len(replica.running),
                    kv_usage=replica.device.used / max(replica.device.capacity, 1))


@dataclass(slots=True)
class ClusterResult:
    replicas: list[SimResult]
    routed: list[int]  # requests routed to each replica (their subagents not counted)
    wallclock_s: float
    measured: set[str] | None = None  # the requests counted (session arrivals' window); None: all
    arrived: int = 0  # requests that arrived, subagents included

    @property
    def records(self) -> list:
        every = (record for result in self.replicas for record in result.records)
        if self.measured is None:
            return list(every)
        return [record for record in every if record.request_id in self.measured]


class Router:
    def __init__(self, routing: Routing, replicas: list[Simulator]) -> None:
        self.routing = routing
        self.replicas = replicas
        self.rank_of: dict[str, int] = {}
        self._next = 0
        self._memory_time = [MemoryTime() for _ in replicas]

    def route(self, request: Request) -> int:
        n = len(self.replicas)
        conversation = conversation_of(request)
        if self.routing is Routing.ROUND_ROBIN:
            rank = self._next % n
        elif self.routing is Routing.SESSION_AFFINE:
            rank = hashed_rank(conversation, n)
        else:
            if self.routing is Routing.LEAST_LOADED:
                loads = [replica_load(r) for r in self.replicas]
                rank = lowest(least_loaded_scores(loads, [0] * n, [load.tracked for load in loads]), self._next)
            else:
                loads = [replica_load(r, m) for r, m in zip(self.replicas, self._memory_time)]
                rank = lowest(mars_scores(loads, [0] * n), self._next)
                known = self.rank_of.get(conversation) if self.routing is Routing.MARS_AFFINE else None
                mean = sum(load.memory_time for load in loads) / n
                if known is not None and loads[known].memory_time <= AFFINITY_BALANCE * mean:
                    rank = known
        self.rank_of[conversation] = rank
        self._next = (self._next + 1) % n
        return rank


def simulate_cluster(requests: list[Request] | SessionStream, make_replica: Callable[[], Simulator], replicas: int,
                     routing: Routing, on_progress: Callable[[int, int], None] | None = None,
                     window: tuple[float, float] | None = None) -> ClusterResult:
    """Run `requests` on `replicas` engines from `make_replica` (each with no requests of its own).
    A `SessionStream` runs with its follow-ups let in as their previous tasks end, counting the
    tasks that arrive in `window` (all of them if None)."""
    if replicas < 1:
        raise ValueError(f"--replicas {replicas}: give 1 or more")
    started = time.perf_counter()
    engines = [make_replica() for _ in range(replicas)]
    router = Router(routing, engines)
    routed = [0] * replicas
    for engine in engines:
        engine.start()
    if isinstance(requests, SessionStream):
        return _run_sessions(requests, engines, router, routed, started, on_progress, window)
    children = _children_of(requests)
    roots = sorted((r for r in requests if r.spawned_by is None), key=lambda r: r.arrival_s)
    for done, request in enumerate(roots):
        for engine in engines:
            engine.run_until(request.arrival_s)
        rank = router.route(request)
        routed[rank] += 1
        engines[rank].inject([request, *_descendants(request, children)])
        if on_progress:
            on_progress(done, len(roots))
    for engine in engines:
        engine.run_until(math.inf)
    if on_progress:
        on_progress(len(roots), len(roots))
    return ClusterResult([engine.finish() for engine in engines], routed, time.perf_counter() - started,
                         arrived=len(requests))


@dataclass(slots=True)
class _Arrivals:
    """Session arrivals due, earliest first: each a task and the requests it starts."""

    heap: list[tuple[float, int, list[Request]]] = field(default_factory=list)
    count: int = 0

    def push(self, group: list[Request]) -> None:
        heapq.heappush(self.heap, (group[0].arrival_s, self.count, group))
        self.count += 1

    @property
    def next_s(self) -> float:
        return self.heap[0][0] if self.heap else math.inf


def _run_sessions(stream: SessionStream, engines: list[Simulator], router: Router, routed: list[int],
                  started: float, on_progress: Callable[[int, int], None] | None,
                  window: tuple[float, float] | None) -> ClusterResult:
    start_s, end_s = window if window is not None else (-math.inf, math.inf)
    children = _children_of(stream.starts)
    due = _Arrivals()
    for request in stream.starts:
        if request.spawned_by is None:
            due.push([request, *_descendants(request, children)])
    measured: set[str] = set()
    unfinished: set[str] = set()  # measured requests not ended yet
    seen = [0] * len(engines)
    arrived = 0
    now = 0.0
    while due.heap or (now < stream.horizon_s and any(engine.unfinished for engine in engines)):
        if now >= end_s and not unfinished:
            break  # everything measured has ended: what runs now is not counted
        now = min(due.next_s, now + SESSION_SLICE_S)
        for engine in engines:
            engine.run_until(now)
        for rank, engine in enumerate(engines):  # tasks that ended: their follow-ups
            for record in engine.records[seen[rank]:]:
                unfinished.discard(record.request_id)
                group = stream.follow_up(record.request_id, record.finish_s, not_before_s=now)
                if group:
                    due.push(group)
            seen[rank] = len(engine.records)
        while due.heap and due.next_s <= now:
            group = heapq.heappop(due.heap)[2]
            rank = router.route(group[0])
            routed[rank] += 1
            engines[rank].inject(group)
            arrived += len(group)
            if start_s <= group[0].arrival_s < end_s:
                ids = {request.request_id for request in group}
                measured |= ids
                unfinished |= ids
        if on_progress:
            on_progress(int(min(now, end_s)), int(end_s) if math.isfinite(end_s) else int(stream.horizon_s))
    if unfinished:  # the stream ran out first: drain without further arrivals
        for engine in engines:
            engine.run_until(math.inf)
    return ClusterResult([engine.finish() for engine in engines], routed, time.perf_counter() - started,
                         measured=measured if window is not None else None, arrived=arrived)


def _children_of(requests: list[Request]) -> dict[str, list[Request]]:
    children: dict[str, list[Request]] = {}
    for request in requests:
        if request.spawned_by is not None:
            children.setdefault(request.spawned_by.parent_id, []).append(request)
    return children


def _descendants(request: Request, children: dict[str, list[Request]]) -> list[Request]:
    found, stack = [], [request.request_id]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child.request_id)
    return found
