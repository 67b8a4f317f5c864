"""The comparison's numbers: per configuration, each metric's median over the repeats with its
spread (min–max), the ratios of medians against stock vLLM, and mars against the best of the
others; the JSON and the Markdown table.

Metrics come from each run's loadgen report (docs/loadgen.md): conversation latency (mean, p99),
turn latency (mean, p99), follow-up TTFT (mean), turns done, failed turns, and, from the run
record, the most requests the engine had waiting. Only complete runs count (`RunRecord.measured`).
Latencies count finished turns and conversations only, so a configuration with errors is not
comparable on them: the table shows its errors beside them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marsched.experiments.http_bench.configs import BASELINE, FOCUS, ORACLE
from marsched.experiments.http_bench.records import RunRecord

SCHEMA = "marsched.http_bench/1"


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    title: str
    read: Callable[[dict[str, Any], RunRecord], float | None]  # (loadgen report, run) -> value
    latency: bool = True  # a time, lower is better: it gets ratios


def _report(group: str, key: str) -> Callable[[dict[str, Any], RunRecord], float | None]:
    return lambda report, run: (report.get(group) or {}).get(key)


METRICS = (
    Metric("conv_e2e_mean_s", "conv e2e mean s", _report("conversations", "e2e_mean_s")),
    Metric("conv_e2e_p99_s", "conv e2e p99 s", _report("conversations", "e2e_p99_s")),
    Metric("turn_e2e_mean_s", "turn mean s", _report("turns", "e2e_mean_s")),
    Metric("turn_e2e_p99_s", "turn p99 s", _report("turns", "e2e_p99_s")),
    Metric("followup_ttft_mean_s", "follow-up TTFT mean s", _report("turns", "followup_ttft_mean_s")),
    Metric("turns_done", "turns done", _report("turns", "finished"), latency=False),
    Metric("errors", "errors", _report("turns", "failed"), latency=False),
    Metric("waiting_max", "waiting max", lambda report, run: (run.queue or {}).get("waiting_max"), latency=False),
)
LATENCIES = tuple(m for m in METRICS if m.latency)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of the values (None where there are none), and the values."""
    if not values:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def summarize(runs: Sequence[RunRecord], configs: Sequence[str], settings: dict[str, Any]) -> dict[str, Any]:
    """The summary JSON of `runs`, configurations in the order of `configs`."""
    reports = {id(run): json.loads(Path(run.loadgen).read_text()) for run in runs if run.measured}
    per_config: dict[str, Any] = {}
    for config in configs:
        mine = [run for run in runs if run.config == config]
        measured = [run for run in mine if run.measured]
        metrics = {}
        for metric in METRICS:
            values = [metric.read(reports[id(run)], run) for run in measured]
            metrics[metric.key] = spread([v for v in values if v is not None])
        per_config[config] = {"runs": len(measured), "runs_failed": len(mine) - len(measured),
                              "bindings": sorted({run.binding for run in mine if run.binding is not None}),
                              "metrics": metrics}
    return {"schema": SCHEMA, "settings": settings, "configs": per_config, "ratios": ratios(per_config),
            "runs": [run.to_dict() for run in runs]}


def ratios(per_config: dict[str, Any]) -> dict[str, Any]:
    """Ratios of medians, for the latencies: every configuration against `vllm-stock`, and `mars`
    against the best (lowest) of the other configurations, named (the oracle diagnostic is no other)."""
    def median(config: str, key: str) -> float | None:
        return per_config[config]["metrics"][key]["median"]

    against_stock = {}
    if BASELINE in per_config:
        against_stock = {config: {m.key: ratio(median(config, m.key), median(BASELINE, m.key)) for m in LATENCIES}
                         for config in per_config if config != BASELINE}
    focus_vs_best: dict[str, Any] = {}
    others = [c for c in per_config if c not in (FOCUS, ORACLE)]
    if FOCUS in per_config and others:
        for m in LATENCIES:
            candidates = [(median(c, m.key), c) for c in others if median(c, m.key) is not None]
            if candidates:
                best_value, best = min(candidates)
                focus_vs_best[m.key] = {"best": best, "ratio": ratio(median(FOCUS, m.key), best_value)}
            else:
                focus_vs_best[m.key] = {"best": None, "ratio": None}
    return {f"vs_{BASELINE}": against_stock, f"{FOCUS}_vs_best_other": focus_vs_best}


def _number(value: float, digits: int) -> str:
    if digits == 0 and value != int(value):  # a median of two counts
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def _cell(stats: dict[str, Any], digits: int) -> str:
    if stats["median"] is None:
        return "–"
    text = _number(stats["median"], digits)
    if stats["min"] != stats["max"]:
        text += f" ({_number(stats['min'], digits)}–{_number(stats['max'], digits)})"
    return text


def _ratio_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def markdown(summary: dict[str, Any]) -> str:
    """The tables: medians (min–max over repeats) per configuration, then the ratios of medians."""
    header = ["config", "runs", *(m.title for m in METRICS)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for config, entry in summary["configs"].items():
        runs = f"{entry['runs']}" + (f" (+{entry['runs_failed']} failed)" if entry["runs_failed"] else "")
        cells = [_cell(entry["metrics"][m.key], 2 if m.latency else 0) for m in METRICS]
        lines.append("| " + " | ".join([config, runs, *cells]) + " |")
    ratio_header = ["ratio of medians (lower is better)", *(m.title for m in LATENCIES)]
    lines += ["", "| " + " | ".join(ratio_header) + " |", "|" + " --- |" * len(ratio_header)]
    for config, values in summary["ratios"][f"vs_{BASELINE}"].items():
        lines.append("| " + " | ".join([f"{config} / {BASELINE}",
                                        *(_ratio_cell(values[m.key]) for m in LATENCIES)]) + " |")
    best = summary["ratios"][f"{FOCUS}_vs_best_other"]
    if best:
        cells = [f"{_ratio_cell(best[m.key]['ratio'])} ({best[m.key]['best'] or '–'})" for m in LATENCIES]
        lines.append("| " + " | ".join([f"{FOCUS} / best other", *cells]) + " |")
    return "\n".join(lines)
