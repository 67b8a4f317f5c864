"""`marsched audit`: check a scheduling trace against the rules of the policy it ran.

`audit_trace(path, policy)` reads the trace once, in order, and hands every event to
the checks (one module each: `order`, `strategy`, `starvation`, `protection`, `lifecycle`,
`memory`), which see the waiting queue as rebuilt from the events before them (`queue_model`).
A trace that cannot be read raises `TraceReadError` with its line number.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass

from marsched.audit.declared import Declared, declared
from marsched.audit.lifecycle import Lifecycle
from marsched.audit.memory import Memory
from marsched.audit.order import RankingOrder
from marsched.audit.protection import ProtectionRule
from marsched.audit.queue_model import QueueModel
from marsched.audit.reader import Line, TraceReadError, read_events
from marsched.audit.starvation import StarvationRule
from marsched.audit.strategy import StrategyRules
from marsched.audit.violations import Check, Violation

__all__ = ["AuditResult", "Check", "TraceReadError", "Violation", "audit_trace"]


@dataclass(frozen=True, slots=True)
class AuditResult:
    path: str
    declared: Declared
    events: int
    requests: int
    violations: list[Violation]
    seconds: float
    notes: tuple[str, ...] = ()  # what the trace did not let the checks decide

    @property
    def clean(self) -> bool:
        return not self.violations

    def counts(self) -> Counter[Check]:
        return Counter(v.check for v in self.violations)


def audit_trace(path: str | os.PathLike[str], policy: str | None = None) -> AuditResult:
    """Audit the trace at `path` as `policy` (a named policy; by default the one it declares)."""
    started = time.perf_counter()
    path = os.fspath(path)
    violations: list[Violation] = []
    report = violations.append
    lines = read_events(path)
    run = next(lines)
    rules = declared(path, run, policy)
    if policy is not None and rules.declared_policy != policy:
        report(Violation(Check.POLICY, None, run.event["t"],
                         f"the trace declares policy '{rules.declared_policy}', audited as '{policy}'",
                         (run.number,)))
    model = QueueModel(rules.starvation)
    lifecycle, memory = Lifecycle(report, run), Memory(report, rules)
    protection = ProtectionRule(report, rules, model)
    checks = [StrategyRules(report, rules), StarvationRule(report, rules, model), protection]
    if rules.order_checked:
        checks.append(RankingOrder(report, rules, model))
    handlers: dict[str, list] = {}
    for check in checks:
        for name in dir(check):
            if name.startswith("on_"):
                handlers.setdefault(name[3:], []).append(getattr(check, name))
    handlers.setdefault("run", []).append(lifecycle.on_run)  # one engine at a time writes the file
    handlers.setdefault("end", []).append(lifecycle.on_end)
    events, last = 1, run
    memory.on_event(run)
    for line in lines:
        events += 1
        last = line
        event = line.event
        if "rid" in event and event["event"] not in ("run", "end", "schedule"):
            lifecycle.on_request_event(line)
        memory.on_event(line)
        for handler in handlers.get(event["event"], ()):
            handler(line)
        model.apply(line)
    lifecycle.finish(last)
    memory.finish(last)
    violations.sort(key=lambda v: (v.t, v.lines))
    return AuditResult(path, rules, events, len(lifecycle.lives), violations, time.perf_counter() - started,
                       tuple(protection.notes()))
