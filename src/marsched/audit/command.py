"""The `marsched audit` command (registered in `marsched.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from marsched.audit import TraceReadError, audit_trace
from marsched.cli_checks import fail
from marsched.policy.registry import POLICY_NAMES

_SHOWN = 50  # violations printed per check; the counts say how many more


def audit(
    trace: Annotated[Path, typer.Argument(help="Event trace (JSONL) from `simulate --trace-out`, vLLM's "
                                               "`trace_path`, or any engine writing trace schema v1.")],
    policy: Annotated[str | None, typer.Option(help=f"Audit as this policy ({', '.join(POLICY_NAMES)}); "
                                                    "default: the one the trace declares.")] = None,
    show: Annotated[int, typer.Option(help="Violations to print for each check.")] = _SHOWN,
) -> None:
    """Check a trace against its policy's rules. Exit 0 clean, 1 with violations, 2 unreadable."""
    if policy is not None and policy not in POLICY_NAMES:
        fail(f"--policy {policy}: unknown policy; valid: {', '.join(POLICY_NAMES)}")
    try:
        result = audit_trace(trace, policy)
    except TraceReadError as error:
        fail(f"unreadable trace: {error}")
    out = Console(highlight=False, soft_wrap=True, emoji=False)
    rules = result.declared
    out.print(f"{trace}: {result.events} events, {result.requests} requests, engine {rules.engine}, audited as "
              f"{rules.policy} (order {rules.order.value}, strategy {rules.rule.value}, starvation "
              f"{rules.starvation.variant}); {result.seconds:.2f} s", markup=False)
    shown: dict[str, int] = {}
    for violation in result.violations:
        check = violation.check.value
        shown[check] = shown.get(check, 0) + 1
        if shown[check] <= show:
            out.print(str(violation), markup=False)
    if result.clean:
        out.print("clean: no violations")
        raise typer.Exit(0)
    summary = ", ".join(f"{count} {check.value}" for check, count in sorted(result.counts().items()))
    hidden = sum(max(n - show, 0) for n in shown.values())
    out.print(f"{len(result.violations)} violations ({summary})" + (f"; {hidden} not shown (--show)" if hidden else ""))
    raise typer.Exit(1)
