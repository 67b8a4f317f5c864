"""The statistics of the claude-code trace that docs/workloads.md gives, as Markdown.

    .venv/bin/python scripts/claude_code_stats.py [--token-scale F]

Everything but the human's gaps is measured on the requests the loader builds (one per task),
so the numbers are what the simulator runs; the human's gaps (after an answer, before the next
task) are in no request and are read from the file itself.
"""

from __future__ import annotations

import argparse
import gzip
import json

import numpy as np

from marsched.workload.loader import load_trace, named_trace
from marsched.workload.model import Request
from marsched.workload.token_scale import check_token_scale, scale_tokens


def _row(name: str, values: list[float], digits: int = 0) -> str:
    a = np.asarray(values, dtype=float)
    cells = [a.mean(), np.median(a), np.percentile(a, 90), np.percentile(a, 99), a.min(), a.max()]
    return f"| {name} | " + " | ".join(f"{v:,.{digits}f}" for v in cells) + " |"


def human_gaps() -> list[float]:
    """`think_time` of the calls that follow an answer (a stop other than tool_use), main agents only."""
    gaps = []
    for line in gzip.decompress(named_trace("claude-code").resource().read_bytes()).splitlines():
        calls = [r for r in json.loads(line)["requests"] if r["type"] != "subagent"]
        gaps += [b["think_time"] for a, b in zip(calls, calls[1:]) if a["stop"] != "tool_use" and "think_time" in b]
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-scale", type=float, default=1.0)
    args = parser.parse_args()
    try:
        check_token_scale(args.token_scale)
    except ValueError as error:
        parser.error(f"argument --token-scale: {error}")
    requests: list[Request] = [scale_tokens(r, args.token_scale) for r in load_trace("claude-code")]
    conversations = {r.request_id.split(":")[0] for r in requests}
    sub = [r for r in requests if ":sa" in r.request_id]
    tied = [r for r in requests if r.spawned_by is not None]
    segments = [s for r in requests for s in r.segments]
    calls = [s.api for r in requests for s in r.segments[:-1]]  # between two calls of a task
    at_calls = [s.context_at_call for r in requests for s in r.segments[:-1]]
    nexts = [s.context_tokens for r in requests for s in r.segments[1:]]
    compacted = [c for c in calls if c.compacts]
    shrinks = [n < a for a, n in zip(at_calls, nexts)]
    dropped = [a - c.kept_tokens for a, c in zip(at_calls, calls) if c.compacts]
    print(f"token scale {args.token_scale:g}")
    print(f"- conversations: {len(conversations)}; requests (tasks): {len(requests)}, of them {len(sub)} of subagents "
          f"({len(tied)} tied to a parent's call); model calls (segments): {len(segments)}")
    print(f"- tool calls inside tasks: {len(calls)}; trailing calls: {sum(r.ends_with_call for r in requests)}; "
          f"tasks without a tool call: {sum(len(r.segments) == 1 for r in requests)}")
    print(f"- calls that keep less than the context at the call: {len(compacted)} ({len(compacted) / len(calls):.1%}); "
          f"calls after which the context is shorter: {sum(shrinks)} ({sum(shrinks) / len(calls):.1%})")
    print(f"- subagents: {len({r.request_id.rsplit(':t', 1)[0] for r in sub})}\n")
    print("| statistic | mean | median | p90 | p99 | min | max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(_row("calls per task", [len(r.segments) for r in requests]))
    print(_row("input tokens per call (context at its start)", [s.context_tokens for s in segments]))
    print(_row("output tokens per call", [s.output_tokens for s in segments]))
    print(_row("prompt tokens per task", [r.prompt_tokens for r in requests]))
    print(_row("longest context per task", [r.final_context_tokens for r in requests]))
    print(_row("tool gap per call (s)", [c.duration_s for c in calls], 1))
    print(_row("tool time per task (s)", [r.api_time_s for r in requests], 1))
    print(_row("tokens a call returns (new input)", [c.return_tokens for c in calls]))
    print(_row("tokens a compaction drops", dropped))
    print(_row("calls per subagent task", [len(r.segments) for r in sub]))
    print(_row("subagent start after its parent's arrival (s)", [r.arrival_s for r in tied], 1))
    print(_row("human gap between tasks (s; in no request)", human_gaps(), 1))


if __name__ == "__main__":
    main()
