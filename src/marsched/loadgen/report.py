"""The replay's numbers: per turn and per conversation, and the JSON report that holds them.

Turns: end-to-end latency (request to the reply's last token), time to first token of every
turn and of follow-ups (turns after a conversation's first, the ones a kept KV cache speeds
up), and throughput. Conversations: arrival to the end of the last reply (tool gaps
included), each conversation's mean follow-up TTFT, and throughput. Latencies count
finished turns and conversations only; throughput divides by the span from the first
request to the last reply's end. Every statistic is `None` where there is nothing to count
(no NaN in the JSON). `docs/loadgen.md` lists the fields.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marsched.atomic import write_atomically
from marsched.loadgen.records import ConversationRecord, TurnRecord

SCHEMA = "marsched.loadgen/1"
PERCENTILES = (50, 99)


def stats(values: Sequence[float], name: str) -> dict[str, float | None]:
    """``{name}_mean_s``, ``{name}_p50_s``, ``{name}_p99_s`` (numpy's linear percentiles); None if empty."""
    data = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"{name}_mean_s": float(data.mean()) if data.size else None}
    for q in PERCENTILES:
        out[f"{name}_p{q}_s"] = float(np.percentile(data, q)) if data.size else None
    return out


def _span(turns: Sequence[TurnRecord]) -> float | None:
    finished = [t for t in turns if t.finished]
    if not finished:
        return None
    span = max(t.end_s for t in finished) - min(t.sent_s for t in finished)
    return span if span > 0 else None


def _per_s(count: float, span: float | None) -> float | None:
    return count / span if span else None


def turn_summary(conversations: Sequence[ConversationRecord], max_tokens: int) -> dict[str, Any]:
    turns = [t for c in conversations for t in c.turns]
    finished = [t for t in turns if t.finished]
    ttft = [t.ttft_s for t in finished if t.ttft_s is not None]
    followup = [t.ttft_s for t in finished if t.index > 0 and t.ttft_s is not None]
    output = sum(t.completion_tokens or 0 for t in finished)
    span = _span(turns)
    return {
        "sent": len(turns), "finished": len(finished), "failed": sum(1 for t in turns if t.error),
        "exact_length": sum(1 for t in finished if t.exact(max_tokens)),
        **stats([t.latency_s for t in finished], "e2e"),
        **stats(ttft, "ttft"),
        "followups": len(followup),
        **stats(followup, "followup_ttft"),
        "per_s": _per_s(len(finished), span),
        "output_tokens": output,
        "output_tokens_per_s": _per_s(output, span),
        "span_s": span,
    }


def conversation_summary(conversations: Sequence[ConversationRecord]) -> dict[str, Any]:
    started = [c for c in conversations if c.started]
    finished = [c for c in started if c.finished]
    mean_followups = []
    for c in finished:
        values = [t.ttft_s for t in c.turns if t.index > 0 and t.ttft_s is not None]
        if values:
            mean_followups.append(float(np.mean(values)))
    span = _span([t for c in conversations for t in c.turns])
    return {
        "planned": len(conversations), "started": len(started), "finished": len(finished),
        "failed": sum(1 for c in started if c.failed),
        "unfinished": sum(1 for c in started if not c.finished and not c.failed),
        **stats([c.e2e_s for c in finished], "e2e"),
        **stats(mean_followups, "followup_ttft"),
        "per_s": _per_s(len(finished), span),
    }


def error_counts(conversations: Sequence[ConversationRecord], limit: int = 10) -> dict[str, int]:
    """The most frequent turn errors, with their counts."""
    counts = Counter(t.error for c in conversations for t in c.turns if t.error)
    return dict(counts.most_common(limit))


def build_report(settings: dict[str, Any], server: dict[str, Any], conversations: Sequence[ConversationRecord],
                 *, wall_s: float, interrupted: bool) -> dict[str, Any]:
    """The whole JSON report (`docs/loadgen.md`, "The JSON report")."""
    return {
        "schema": SCHEMA,
        "interrupted": interrupted,
        "settings": settings,
        "server": server,
        "wall_s": wall_s,
        "turns": turn_summary(conversations, settings["max_tokens"]),
        "conversations": conversation_summary(conversations),
        "errors": error_counts(conversations),
        "records": [c.to_dict() for c in conversations if c.started],
    }


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """Write the report as JSON: complete or not at all (`marsched.atomic`)."""
    text = json.dumps(report, indent=1, allow_nan=False) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))
