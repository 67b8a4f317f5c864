"""No request is lost, none arrives or finishes twice, and none has events outside its life; one
engine at a time writes the trace (a run starts only after the one before it ended)."""

from __future__ import annotations

from dataclasses import dataclass

from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation


@dataclass(slots=True)
class _Life:
    arrive: Line
    last: Line
    finish: Line | None = None


class Lifecycle:
    def __init__(self, report, run: Line) -> None:
        self.report = report
        self.lives: dict[str, _Life] = {}
        self.open_run: Line | None = run  # the run that has not ended yet

    def on_run(self, line: Line) -> None:
        """A restarted engine appends its run after the last one's `end`; a run that starts before
        it is a second engine writing the same file (data-parallel ranks, two servers)."""
        if self.open_run is not None:
            self.report(Violation(Check.LIFECYCLE, None, line.event["t"],
                                  f"a run starts at line {line.number} while the run of line {self.open_run.number} "
                                  "has not ended: two engines wrote this trace (give each its own file)",
                                  (self.open_run.number, line.number)))
        self.open_run = line

    def on_end(self, line: Line) -> None:
        self.open_run = None

    def on_request_event(self, line: Line) -> None:
        event = line.event
        rid, kind = event["rid"], event["event"]
        life = self.lives.get(rid)
        if kind == "arrive":
            if life is not None:
                self.report(Violation(Check.LIFECYCLE, rid, event["t"],
                                      f"arrived twice (first at t={life.arrive.event['t']:.6g}s)",
                                      (life.arrive.number, line.number)))
                return
            self.lives[rid] = _Life(line, line)
            return
        if life is None:
            self.report(Violation(Check.LIFECYCLE, rid, event["t"],
                                  f"{kind} event for a request that never arrived", (line.number,)))
            self.lives[rid] = life = _Life(line, line)
        if life.finish is not None:
            first = life.finish.event
            what = "finished twice" if kind == "finish" else f"{kind} event after the request finished"
            self.report(Violation(Check.LIFECYCLE, rid, event["t"], f"{what} (finished at t={first['t']:.6g}s)",
                                  (life.finish.number, line.number)))
            return
        life.last = line
        if kind == "finish":
            life.finish = line

    def finish(self, last: Line) -> None:
        for rid, life in self.lives.items():
            if life.finish is None:
                seen = life.last.event
                self.report(Violation(
                    Check.LIFECYCLE, rid, seen["t"],
                    f"lost: arrived at t={life.arrive.event['t']:.6g}s and never finished; its last event is "
                    f"{seen['event']} at t={seen['t']:.6g}s (the trace ends at t={last.event['t']:.6g}s)",
                    (life.arrive.number, life.last.number)))
