"""The `marsched audit` command (registered in `marsched.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from marsched.audit import TraceReadError, audit_trace
from marsched.cli_checks import fail
from marsched.policy.policy import Protection
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
              f"{rules.starvation.variant}{_protection(rules)}); {result.seconds:.2f} s", markup=False)
    if not rules.order_checked:
        out.print(f"order not checked: {rules.policy} admits from two queues in passes, and a request that "
                  "can take its blocks may pass one that cannot", markup=False)
    for note in result.notes:
        out.print(note, markup=False)
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


def _protection(rules) -> str:
    """How long an admitted promoted request is protected from preemption, for the header."""
    s = rules.starvation
    if not s.enabled:
        return ""
    span = f"{s.quantum} iterations" if s.protection is Protection.QUANTUM else "to the segment's end"
    return f", protection {span}{', for life' if s.for_life else ''}"


def plot(
    trace: Annotated[Path | None, typer.Argument(help="Event trace (JSONL) to draw.")] = None,
    metrics: Annotated[Path | None, typer.Option(help="Metrics JSON (`simulate`/`compare`/`bench --json`) "
                                                     "to draw latency CDFs from, instead of a trace.")] = None,
    out: Annotated[Path | None, typer.Option(help="PNG to write (default: beside the input, .png).")] = None,
    requests: Annotated[int, typer.Option(help="Requests shown in the per-request timeline.")] = 40,
) -> None:
    """Draw a run: queue lengths, KV memory and per-request timelines (TRACE), or latency CDFs (--metrics)."""
    import json

    from marsched.audit.plot import plot_cdfs, plot_trace
    from marsched.audit.timeline import build_timeline

    if (trace is None) == (metrics is None):
        fail("give a trace to draw, or --metrics JSON, not both")
    source = trace or metrics
    out = out or source.with_suffix(".png")
    if requests < 1:
        fail(f"--requests {requests}: give a number of requests >= 1")
    if trace is not None:
        try:
            timeline = build_timeline(trace)
        except TraceReadError as error:
            fail(f"unreadable trace: {error}")
        draw = lambda: plot_trace(timeline, out, requests)  # noqa: E731
    else:
        try:
            records = json.loads(metrics.read_text())
        except (OSError, ValueError) as error:
            fail(f"--metrics {metrics}: cannot read: {error}")
        records = records if isinstance(records, list) else [records]
        missing = [i for i, r in enumerate(records) if not isinstance(r, dict) or "e2e_cdf_s" not in r]
        if not records or missing:
            fail(f"--metrics {metrics}: record {missing[0] if missing else 0} has no latency distribution "
                 "(e2e_cdf_s, ttft_cdf_s): write it with this marsched's --json")
        draw = lambda: plot_cdfs(records, out)  # noqa: E731
    try:
        draw()
    except OSError as error:
        fail(f"--out {out}: writing failed: {error.strerror or error}")
    print(out)


def export(
    trace: Annotated[Path, typer.Argument(help="Event trace (JSONL) to convert.")],
    perfetto: Annotated[Path, typer.Option(help="Write the Chrome Trace Event JSON here (open it in "
                                                "ui.perfetto.dev or chrome://tracing).")],
) -> None:
    """Convert a trace for Perfetto: a track per request, counters for queue lengths and KV memory."""
    from marsched.audit.perfetto import write_chrome_trace
    from marsched.audit.timeline import build_timeline

    try:
        timeline = build_timeline(trace)
    except TraceReadError as error:
        fail(f"unreadable trace: {error}")
    try:
        write_chrome_trace(timeline, perfetto)
    except OSError as error:
        fail(f"--perfetto {perfetto}: writing failed: {error.strerror or error}")
    print(perfetto)
