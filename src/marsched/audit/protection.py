"""No protected request is preempted (starvation prevention's protection, `Policy.protect`).

Who is protected follows from the trace and the `run` event's `policy.starvation`:

- protection starts when a request is admitted from the promoted lane: promoted during this
  stay in the queue (a `promote` event), or, once promoted for life (`for_life`), at every
  admission after. The queue model (`queue_model.py`) knows both; the admit's own `promoted`
  flag is the engine's claim, which the order check holds to them;
- under `quantum` protection it lasts `quantum` iterations: admitted at iteration i, the
  request may not be preempted at iterations i to i + quantum - 1, and may be from
  i + quantum on; under `segment` protection it lasts while the request is in the segment
  it was admitted in (the events' `segment`). A later protecting admission replaces it; a
  request re-admitted without one keeps what is left of the old (`Policy.is_protected`);
- an engine may state the protection an `admit` or `resume` event leaves the request with:
  `protected_until` (the first iteration it may be preempted again; null: none) and
  `protected_segment` (the segment it may not be preempted in; null: none). The audit then
  goes by the statement, and on an `admit` checks it against the declared rule.

A protected victim is a violation, but for one case: when no request running beside it is
unprotected, the request that needs the blocks gives up its own (the simulator's rule; the
policy leaves nothing else to take). The `preempt` event names that request in `requester`,
when the engine writes it; when it does not, the audit cannot tell this yield from another
protected request's eviction, accepts it, and counts it (`unattributed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from marsched.audit.declared import Declared
from marsched.audit.queue_model import QueueModel
from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation
from marsched.policy.policy import Protection

_STATED = ("protected_until", "protected_segment")


@dataclass(frozen=True, slots=True)
class Guard:
    """A request's protection: not preempted before iteration `until`, nor while in `segment`."""

    line: Line  # the event it comes from: the protecting admission, or an engine's statement
    until: int | None = None
    segment: int | None = None

    def holds(self, iteration: int, segment: int) -> bool:
        return (self.until is not None and iteration < self.until) or self.segment == segment

    def effective(self, iteration: int, segment: int) -> tuple[int | None, int | None]:
        """What is left of it now, comparable whatever an engine keeps of an expired one."""
        return (self.until if self.until is not None and self.until > iteration else None,
                self.segment if self.segment == segment else None)

    def describe(self) -> str:
        e = self.line.event
        since = f"{e['event']} at iteration {e['iteration']} (t={e['t']:.6g}s)"
        if self.until is not None:
            return f"protected until iteration {self.until} since its {since}"
        return f"protected in segment {self.segment} since its {since}"


class ProtectionRule:
    def __init__(self, report, declared: Declared, model: QueueModel) -> None:
        self.report = report
        self.rule = declared.starvation
        self.model = model
        self.guards: dict[str, Guard] = {}
        self.segment: dict[str, int] = {}  # each request's current segment
        self.queue: dict[str, str] = {}  # each request's queue after its last event
        # Running requests, with the first iteration at which each can be a victim.
        self.running: dict[str, int | None] = {}
        self.unattributed = 0  # protected victims accepted because the trace does not name the requester

    def _violation(self, line: Line, message: str, *others: Line) -> None:
        e = line.event
        lines = (*(o.number for o in others), line.number)
        self.report(Violation(Check.PROTECTION, e.get("rid"), e["t"], message, lines))

    # --- who is protected ---------------------------------------------------------------

    def _protects(self, line: Line) -> bool:
        """Whether this admission protects: from the promoted lane, by a promotion or for life."""
        rid = line.event["rid"]
        waiting = self.model.waiting.get(rid)
        promoted = waiting is not None and waiting.promoted_at is not None and waiting.promoted_at.event["event"] == "promote"
        return promoted or (self.rule.for_life and rid in self.model.elder)

    def _declared_guard(self, line: Line) -> Guard:
        e = line.event
        if self.rule.protection is Protection.QUANTUM:
            return Guard(line, until=e["iteration"] + self.rule.quantum)
        return Guard(line, segment=e["segment"])

    def _stated_guard(self, line: Line) -> Guard:
        e = line.event
        return Guard(line, e.get("protected_until"), e.get("protected_segment"))

    def _protected(self, rid: str, iteration: int, segment: int) -> Guard | None:
        guard = self.guards.get(rid)
        return guard if guard is not None and guard.holds(iteration, segment) else None

    # --- events -------------------------------------------------------------------------

    def _moved(self, line: Line) -> None:
        e = line.event
        rid = e["rid"]
        self.segment[rid] = e["segment"]
        self.queue[rid] = e.get("queue")
        if e.get("queue") != "running":
            self.running.pop(rid, None)
        elif e["event"] == "swap_in":
            self.running[rid] = e["iteration"] + 1
        elif e["event"] == "resume":
            # vLLM takes a request back from a preserved call into its batch only in the step
            # after, past that step's preemptions; the simulator at once.
            self.running[rid] = e["iteration"] + 2

    on_arrive = on_promote = on_api_start = on_swap_out = on_api_end = on_swap_in = _moved

    def on_admit(self, line: Line) -> None:
        e = line.event
        rid = e["rid"]
        if self.rule.enabled and self._protects(line):
            expected = self._declared_guard(line)
        else:
            expected = self.guards.get(rid)
        if any(key in e for key in _STATED):
            stated = self._stated_guard(line)
            now = (e["iteration"], e["segment"])
            want = expected.effective(*now) if expected is not None else (None, None)
            got = stated.effective(*now)
            for key, w, g in zip(_STATED, want, got):
                if key in e and w != g:
                    self._violation(line, f"admit reports {key}={e[key]!r}, but the declared rule ({self._rule_name()}) "
                                          f"gives {w!r}{self._why(line)}")
            if got != want:
                expected = stated
        if expected is not None:
            self.guards[rid] = expected
        swapping_in = self.queue.get(rid) == "swapped"
        self._moved(line)
        self.running[rid] = None if swapping_in else e["iteration"] + 1

    def on_resume(self, line: Line) -> None:
        e = line.event
        if any(key in e for key in _STATED):
            stated = self._stated_guard(line)
            current = self.guards.get(e["rid"])
            now = (e["iteration"], e["segment"])
            if current is None or current.effective(*now) != stated.effective(*now):
                self.guards[e["rid"]] = stated
        self._moved(line)

    def on_preempt(self, line: Line) -> None:
        e = line.event
        rid, iteration = e["rid"], e["iteration"]
        guard = self._protected(rid, iteration, e["segment"])
        self.running.pop(rid, None)
        self._moved(line)
        if guard is None:
            return
        unprotected = sorted(r for r, since in self.running.items()
                             if since is not None and since <= iteration
                             and self._protected(r, iteration, self.segment.get(r, -1)) is None)
        requester = e.get("requester")
        if unprotected:
            names = ", ".join(unprotected[:3]) + (f" and {len(unprotected) - 3} more" if len(unprotected) > 3 else "")
            self._violation(line, f"preempted at iteration {iteration} while {guard.describe()}, although unprotected "
                                  f"{names} {'was' if len(unprotected) == 1 else 'were'} running: the victim is the "
                                  "lowest-ranked unprotected request", guard.line)
        elif requester is not None and requester != rid:
            self._violation(line, f"preempted at iteration {iteration} for {requester} while {guard.describe()}: with "
                                  "every running request protected, the request that needs the blocks gives up its "
                                  "own, not another protected one's", guard.line)
        elif requester is None:
            self.unattributed += 1

    def on_finish(self, line: Line) -> None:
        self._moved(line)
        self.guards.pop(line.event["rid"], None)

    # --- helpers ------------------------------------------------------------------------

    def _rule_name(self) -> str:
        if self.rule.protection is Protection.QUANTUM:
            return f"quantum of {self.rule.quantum} iterations"
        return "segment protection"

    def _why(self, line: Line) -> str:
        if not self.rule.enabled:
            return ": starvation prevention is off"
        if self._protects(line):
            return ": it leaves the promoted lane"
        return ": it was not promoted" if line.event["rid"] not in self.guards else ""

    def notes(self) -> list[str]:
        if not self.unattributed:
            return []
        return [f"protection: {self.unattributed} protected request(s) preempted while every request running beside "
                "them was protected; the trace does not name the requester (preempt.requester), so whether each "
                "gave up its own blocks or another protected request's was not checked"]
