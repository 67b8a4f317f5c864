"""The starvation counter follows the rule the trace declares (`run` event, `policy.starvation`).

The counter grows only while a request waits in the queue (in iterations or seconds, as
declared; under `requeued`, only once it has run); every admission reports it, and it must
match what the request's queue stays add up to. A request is promoted when, and not before,
its counter reaches the threshold: one past it and still unpromoted at an iteration's end
is starved. A threshold that moves with the first-come-first-served wait (`fcfs_multiple`)
is reported by each `promote` and `schedule` event; the audit holds the run to the reported
value, which may not be below the declared floor (the estimate itself is the engine's).
With prevention off, nothing is promoted. That promoted requests go first is
the order check's (`order.py`).
"""

from __future__ import annotations

from marsched.audit.declared import Declared
from marsched.audit.queue_model import QueueModel
from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation

# A seconds clock is read at slightly different moments for the counter and for the event's
# stamp (and written to the microsecond); iterations are exact.
_SECONDS_SLACK = 0.05
_ITERATIONS_SLACK = 1e-9


class StarvationRule:
    def __init__(self, report, declared: Declared, model: QueueModel) -> None:
        self.report = report
        self.rule = declared.starvation
        self.model = model
        self.slack = _SECONDS_SLACK if model.seconds else _ITERATIONS_SLACK
        self.unit = "s" if model.seconds else " iterations"
        self.starved: set[int] = set()  # stays reported already (by id), so each is told once
        self.threshold = self.rule.threshold  # in force: the declared one, or the last one an event reported

    def _threshold_of(self, line: Line) -> float:
        """The threshold in force at this event (a moving threshold is reported by the event)."""
        e = line.event
        if not self.rule.moves:
            return self.rule.threshold
        reported = e.get("threshold")
        if not isinstance(reported, (int, float)):
            self._violation(line, f"the threshold of '{self.rule.variant}' moves with the FCFS wait, but this "
                                  f"{e['event']} event does not report it")
            return self.threshold
        if reported < self.rule.threshold - self.slack:
            self._violation(line, f"reports threshold {self._fmt(reported)}, below the declared floor "
                                  f"{self._fmt(self.rule.threshold)}")
        self.threshold = float(reported)
        return self.threshold

    def _violation(self, line: Line, message: str, *others: Line | None) -> None:
        e = line.event
        lines = (line.number, *(o.number for o in others if o is not None))
        self.report(Violation(Check.STARVATION, e.get("rid"), e["t"], message, lines))

    def _fmt(self, value: float) -> str:
        return f"{value:.6g}{self.unit}"

    def on_promote(self, line: Line) -> None:
        e = line.event
        if not self.rule.enabled:
            self._violation(line, f"promoted although starvation prevention is off (variant '{self.rule.variant}')")
            return
        waiting = self.model.waiting.get(e["rid"])
        if waiting is None or waiting.promoted:
            self._violation(line, "promoted while not waiting in the queue" if waiting is None else
                            "promoted twice in one stay in the queue", waiting.promoted_at if waiting else None)
            return
        if not waiting.counted:
            self._violation(line, f"promoted, but under '{self.rule.variant}' ({self.rule.counts.value}) its waiting "
                                  "does not count: it has not run before", waiting.entered)
            return
        counter = self.model.counter(waiting, e)
        threshold = self._threshold_of(line)
        if counter < threshold - self.slack:
            self._violation(line, f"promoted early: its counter is {self._fmt(counter)} (queue stays since "
                                  f"{self._fmt(waiting.since)}), below the threshold {self._fmt(threshold)}",
                            waiting.entered)
        elif abs(e["counter"] - counter) > self.slack:
            self._violation(line, f"the promote event reports counter {self._fmt(e['counter'])}, but its queue stays "
                                  f"add up to {self._fmt(counter)}", waiting.entered)

    def on_admit(self, line: Line) -> None:
        e = line.event
        waiting = self.model.waiting.get(e["rid"])
        if waiting is None:
            return  # the order check reports it
        if not waiting.counted:
            if e["counter"] and self.rule.enabled:
                self._violation(line, f"admitted with counter {self._fmt(e['counter'])}, but under "
                                      f"'{self.rule.variant}' this stay does not count", waiting.entered)
            return
        counter = self.model.counter(waiting, e)
        if abs(e["counter"] - counter) > self.slack:
            self._violation(line, f"the admit event reports counter {self._fmt(e['counter'])}, but its queue stays "
                                  f"add up to {self._fmt(counter)}: the counter does not count waiting as declared",
                            waiting.entered)
        if (not waiting.promoted and not self.rule.per_service and counter >= self.threshold + self.slack
                and waiting.entered.event["iteration"] < e["iteration"]):
            self._starved(line, waiting, counter, self.threshold)

    def on_schedule(self, line: Line) -> None:
        if not self.rule.enabled or self.rule.per_service:
            return
        threshold = self._threshold_of(line)
        for waiting in self.model.overdue(line.event, threshold, self.slack):
            self._starved(line, waiting, self.model.counter(waiting, line.event), threshold)

    def _starved(self, line: Line, waiting, counter: float, threshold: float | None = None) -> None:
        if id(waiting) in self.starved:
            return
        self.starved.add(id(waiting))
        e = line.event
        self.report(Violation(
            Check.STARVATION, waiting.rid, e["t"],
            f"not promoted: its counter is {self._fmt(counter)} at iteration {e['iteration']}, past the threshold "
            f"{self._fmt(self.threshold if threshold is None else threshold)} ({self.rule.variant}); a counter that never changes the order starves "
            "long requests", (waiting.entered.number, line.number)))
