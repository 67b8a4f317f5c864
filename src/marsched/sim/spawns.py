"""Subagents held back until their parent's call starts (`Request.spawned_by`).

A subagent's recorded arrival is the parent's call in the recorded timeline; in a run the
parent reaches that call earlier or later. So the requests a call starts are held until the
parent starts that call in the run, and then arrive shifted together: the first at once, the
others (a subagent's later tasks, a second subagent of the same call) keeping their recorded
offsets from it.
"""

from __future__ import annotations

from dataclasses import replace

from marsched.workload.model import Request


class HeldSpawns:
    """The requests that a parent's call starts, by (parent id, segment index), until it does."""

    def __init__(self, requests: list[Request]) -> None:
        by_id = {r.request_id: r for r in requests}
        self.held: dict[tuple[str, int], list[Request]] = {}
        for request in requests:
            spawn = request.spawned_by
            if spawn is None:
                continue
            parent = by_id.get(spawn.parent_id)
            if parent is None:
                raise ValueError(f"request {request.request_id!r} is started by {spawn.parent_id!r}, "
                                 f"which is not among the run's requests")
            if not (0 <= spawn.segment_index < len(parent.segments)) or parent.segments[spawn.segment_index].api is None:
                raise ValueError(f"request {request.request_id!r} is started by segment {spawn.segment_index} of "
                                 f"{spawn.parent_id!r}, which has no such call")
            self.held.setdefault((spawn.parent_id, spawn.segment_index), []).append(request)
        for group in self.held.values():
            group.sort(key=lambda r: r.arrival_s)

    def roots(self, requests: list[Request]) -> list[Request]:
        """The requests that arrive by themselves."""
        return [r for r in requests if r.spawned_by is None]

    def release(self, parent_id: str, segment_index: int, now_s: float) -> list[Request]:
        """The requests the parent's call starting at `now_s` starts, with their arrival times in the run."""
        group = self.held.pop((parent_id, segment_index), None)
        if not group:
            return []
        first = group[0].arrival_s
        return [replace(r, arrival_s=now_s + (r.arrival_s - first)) for r in group]
