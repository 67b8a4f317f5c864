"""Device and host KV blocks in use stay within capacity, and nothing is held at the end."""

from __future__ import annotations

from marsched.audit.declared import Declared
from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation


class Memory:
    def __init__(self, report, declared: Declared) -> None:
        self.report = report
        self.capacity = {"kv_device_blocks": declared.device_blocks, "kv_host_blocks": declared.host_blocks}
        self.over: set[str] = set()  # report each pool's first excursion, not every event of it
        self.end: Line | None = None

    def on_event(self, line: Line) -> None:
        event = line.event
        if event["event"] == "end":
            self.end = line
        if (0 <= event["kv_device_blocks"] <= self.capacity["kv_device_blocks"]
                and 0 <= event["kv_host_blocks"] <= self.capacity["kv_host_blocks"] and not self.over):
            return  # the common case, checked first
        for field, capacity in self.capacity.items():
            used = event[field]
            pool = "device" if field == "kv_device_blocks" else "host"
            if not 0 <= used <= capacity:
                if pool not in self.over:
                    self.over.add(pool)
                    self.report(Violation(Check.MEMORY, event.get("rid"), event["t"],
                                          f"{used} {pool} KV blocks in use after {event['event']}, "
                                          f"outside 0..{capacity} (the {pool} capacity)", (line.number,)))
            else:
                self.over.discard(pool)

    def finish(self, last: Line) -> None:
        if self.end is None:
            self.report(Violation(Check.MEMORY, None, last.event["t"],
                                  "the trace has no end event: the run was cut short, so what it held at the "
                                  "end is unknown", (last.number,)))
            return
        event = self.end.event
        for field in self.capacity:
            if event[field]:
                pool = "device" if field == "kv_device_blocks" else "host"
                self.report(Violation(Check.MEMORY, None, event["t"],
                                      f"{event[field]} {pool} KV blocks still held when the run ended (leaked)",
                                      (self.end.number,)))
