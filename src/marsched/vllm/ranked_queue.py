"""A vLLM `RequestQueue` whose order is `marsched.policy.WaitingQueue`'s.

vLLM's scheduler reads its waiting queue with `peek_request` and then
`pop_request` (or leaves the head in place when it does not fit). `WaitingQueue`
has `pop` and `push_back`, so a peek pops the head and holds it; any other
operation puts the held request back first (`push_back`, so its starvation
counter keeps running). Prepending (vLLM's path for preempted and skipped
requests) is an ordinary push: in a ranked queue the rank decides.

Admission: while the scheduler builds a step (`gating`), the queue reads as empty
when its head may not be admitted (`admits`, the policy's predicted-peak rule), so
vLLM's waiting loop stops there, as the simulator's does.

Faults: with `on_fault`, a request whose key the policy cannot compute is left out of
the queue and reported (`on_fault(request, error, where)`; the scheduler ends it with
an error) instead of raising into vLLM's step. A refresh that fails for one request
rebuilds the queue from the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from marsched.policy import EngineLoad, Policy, RequestProgress, WaitingQueue


class RankedRequestQueue(RequestQueue):
    def __init__(
        self,
        policy: Policy,
        progress_of: Callable[[Request], RequestProgress],
        load: Callable[[], EngineLoad],
        iteration: Callable[[], int],
        now: Callable[[], float],
        admits: Callable[[Request], bool] | None = None,
        on_fault: Callable[[Request, BaseException, str], Any] | None = None,
    ) -> None:
        self.queue = WaitingQueue(policy)
        self._progress_of = progress_of
        self._load = load
        self._iteration = iteration
        self._now = now
        self._admits = admits
        self._on_fault = on_fault
        self.gating = False  # set by the scheduler around its step
        self._requests: dict[str, Request] = {}
        self._held: Request | None = None
        self.popped: set[str] = set()  # ids popped since the scheduler last took this set (its admissions)

    # --- the scheduler's per-iteration calls ----------------------------------------

    def promote_starving(self, iteration: int, now_s: float) -> list[RequestProgress]:
        self._unhold()
        return self.queue.promote_starving(iteration, now_s)

    def threshold(self, now_s: float) -> float | None:
        return self.queue.threshold(now_s)

    def refresh(self, load: EngineLoad, iteration: int) -> bool:
        self._unhold()
        try:
            return self.queue.refresh(load, iteration)
        except Exception:
            if self._on_fault is None:
                raise
        # A key failed midway: the heap is half rebuilt. Take every request out (their
        # starvation counts are kept in their progress) and push each back with a fresh key.
        requests = list(self._requests.values())
        for request in requests:
            self.queue.remove(request.request_id, iteration, self._now())
        self._requests.clear()
        for request in requests:
            self.add_request(request)
        return True

    def head_key(self) -> float | None:
        """The lowest key left waiting outside the promoted lane, for the event trace."""
        self._unhold()
        return self.queue.head_key()

    def starvation_counter(self, request_id: str) -> int:
        return self.queue.starvation_counter(request_id, self._iteration(), self._now())

    # --- RequestQueue -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._unhold()
        try:
            self.queue.push(self._progress_of(request), self._load(), self._iteration())
        except Exception as error:
            if self._on_fault is None:
                raise
            self._on_fault(request, error, "ranking a waiting request")
            return
        self._requests[request.request_id] = request

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def peek_request(self) -> Request:
        if self._held is None:
            progress = self.queue.pop(self._iteration(), self._now())
            if progress is None:
                raise IndexError("peek from an empty queue")
            self._held = self._requests[progress.request_id]
        return self._held

    def pop_request(self) -> Request:
        request = self.peek_request()
        self._held = None
        del self._requests[request.request_id]
        self.popped.add(request.request_id)
        return request

    def remove_request(self, request: Request) -> None:
        rid = request.request_id
        if rid not in self._requests:
            raise ValueError(f"request {rid!r} is not in the ranked queue")
        self._unhold()  # a held request left the queue at its peek: back first, so its count runs to now
        self.queue.remove(rid, self._iteration(), self._now())
        del self._requests[rid]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        # vLLM removes the same list from several queues: absent requests are skipped.
        for request in requests:
            if request.request_id in self._requests:
                self.remove_request(request)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.request_id in self._requests

    def __bool__(self) -> bool:
        if not self._requests:
            return False
        if self.gating and self._admits is not None:
            return self._admits(self.peek_request())
        return True

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        self._unhold()
        return iter([self._requests[p.request_id] for p in self.queue.ordered()])

    def _unhold(self) -> None:
        if self._held is not None:
            self.queue.push_back(self._progress_of(self._held))
            self._held = None
