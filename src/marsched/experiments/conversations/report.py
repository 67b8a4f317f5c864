"""The benchmark's numbers: each configuration's summary and the Markdown table against stock vLLM."""

from __future__ import annotations

import math
import statistics
from typing import Any

from marsched.experiments.conversations.client import ConversationResult


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100  # linear interpolation, as numpy's default
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[ConversationResult]) -> dict[str, Any]:
    followups = [t.ttft_s for r in results for t in r.turns if t.index > 0 and t.ttft_s is not None]
    firsts = [t.ttft_s for r in results for t in r.turns if t.index == 0 and t.ttft_s is not None]
    e2e = [r.e2e_s for r in results if r.e2e_s is not None]
    failed = [r for r in results if r.error]
    return {
        "conversations": len(results), "completed": len(e2e), "failed": len(failed),
        "followup_turns": len(followups),
        "followup_ttft_mean_s": statistics.fmean(followups) if followups else None,
        "followup_ttft_p50_s": percentile(followups, 50), "followup_ttft_p99_s": percentile(followups, 99),
        "first_ttft_mean_s": statistics.fmean(firsts) if firsts else None,
        "e2e_mean_s": statistics.fmean(e2e) if e2e else None, "e2e_p99_s": percentile(e2e, 99),
        "errors": sorted({r.error for r in failed})[:5],
    }


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}"


def table(records: list[dict[str, Any]]) -> str:
    base = next((r.get("summary") for r in records if r["config"] == "vllm" and "summary" in r), None) or {}
    lines = ["| config | conv ok/all | follow-up TTFT mean / p50 / p99 s | e2e mean / p99 s "
             "| TTFT mean, p99 vs vLLM | e2e mean, p99 vs vLLM | retention hits / misses | prefix-cache hit rate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        s, c = r.get("summary"), r.get("server", {})
        if s is None:
            lines.append(f"| {r['config']} | did not run: {r.get('error', '?').splitlines()[0][:80]} | | | | | | |")
            continue
        hits = (f"{c['retention_hits']} / {c.get('retention_misses', '–')}" if "retention_hits" in c else "–")
        rate = fmt(c.get("prefix_cache_hit_rate"), 2)
        lines.append(
            f"| {r['config']} | {s['completed']}/{s['conversations']} "
            f"| {fmt(s['followup_ttft_mean_s'])} / {fmt(s['followup_ttft_p50_s'])} / {fmt(s['followup_ttft_p99_s'])} "
            f"| {fmt(s['e2e_mean_s'], 2)} / {fmt(s['e2e_p99_s'], 2)} "
            f"| {ratio(s['followup_ttft_mean_s'], base.get('followup_ttft_mean_s'))}, "
            f"{ratio(s['followup_ttft_p99_s'], base.get('followup_ttft_p99_s'))} "
            f"| {ratio(s['e2e_mean_s'], base.get('e2e_mean_s'))}, {ratio(s['e2e_p99_s'], base.get('e2e_p99_s'))} "
            f"| {hits} | {rate} |")
    return "\n".join(lines)


def soak_table(records: list[dict[str, Any]]) -> str:
    """Memory and what is left after the idle wait, one row per configuration (`--soak`)."""
    lines = ["| config | conv failed | RSS start / peak / end MiB | RSS growth MiB | alive, health | left after idle |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        rss, left = r.get("rss") or {}, r.get("after_idle") or {}
        held = {k: v for k, v in left.items() if k not in ("idle_s", "alive", "health") and v}
        lines.append(f"| {r['config']} | {(r.get('summary') or {}).get('failed', '–')} | "
                     f"{fmt(rss.get('start_mib'), 0)} / {fmt(rss.get('peak_mib'), 0)} / {fmt(rss.get('end_mib'), 0)} | "
                     f"{fmt(rss.get('growth_mib'), 0)} | {left.get('alive', '–')}, {left.get('health', '–')} | "
                     f"{', '.join(f'{k} {v}' for k, v in held.items()) or 'nothing'} |")
    return "\n".join(lines)
