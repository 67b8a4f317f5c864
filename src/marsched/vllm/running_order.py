"""vLLM's running list with the lifecycle's preemption victim (`marsched.lifecycle.choose_victim`).

vLLM's FCFS scheduler, when a running request cannot grow, looks at `running[-1]` and pops it
(`Scheduler.schedule`; the request it was scheduling is `running[req_index]`). `RunningOrder`
is that list for one step: sorted best-ranked first (the order vLLM schedules them in), and
its last element, read by vLLM at a preemption, is the victim the one rule names: the
lowest-ranked unprotected request not yet scheduled this step (the requester and those after
it), or the requester itself when every one of them is protected. vLLM replaces the list with
a plain one when requests end; the scheduler wraps it again at the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marsched.lifecycle import choose_victim


class RunningOrder(list):
    def __init__(self, requests: list[Any], is_protected: Callable[[Any], bool],
                 victim_key: Callable[[Any], float]) -> None:
        super().__init__(requests)
        self._is_protected = is_protected
        self._victim_key = victim_key
        self._requester: Any = None  # the request vLLM read last by its index: the one it schedules
        self._victim: Any = None  # named by the last read of [-1], taken by the next pop()

    def __getitem__(self, index: Any) -> Any:
        if type(index) is not int:
            return super().__getitem__(index)
        if index == -1 and self:
            requester = self._requester if self._requester is not None else super().__getitem__(-1)
            self._victim = choose_victim(self._not_scheduled(requester), requester, self._is_protected,
                                         self._victim_key)
            return self._victim
        item = super().__getitem__(index)
        if index >= 0:
            self._requester = item
        return item

    def _not_scheduled(self, requester: Any) -> list[Any]:
        """The requester and the requests after it, last first (on a tie of keys the later one goes,
        as vLLM's own FCFS preemption takes the tail): vLLM has scheduled those before it this step,
        and its FCFS path pops a victim without unscheduling it (the step's output would then hold
        more requests than `running`, which vLLM asserts against). The order puts the victim there
        anyway, except on a tie of keys with an earlier request."""
        for position in range(len(self)):
            if super().__getitem__(position) is requester:
                return super().__getitem__(slice(position, None))[::-1]
        return list(self)[::-1]

    @property
    def requester(self) -> Any:
        """The request vLLM was scheduling at its last read by index (what a preemption makes room for)."""
        return self._requester

    def pop(self, index: int = -1) -> Any:
        victim, self._victim = self._victim, None
        if index == -1 and victim is not None:
            for i, request in enumerate(self):
                if request is victim:
                    return super().pop(i)
        return super().pop(index)
