"""The twin's records and table: one record per configuration, load and repeat, each holding the
simulated and the live numbers per task; the table puts them side by side with their ratio.

A record (`results/twin/*/records.json`, schema `marsched.twin/1`):
``{"config", "load": {"name", "rate"}, "repeat", "sim": {...}, "live": {...} | null}``, where
`sim` and `live` each hold at least ``e2e_mean_s`` and ``e2e_p99_s`` over the tasks that finished
(a task is one conversation of `marsched loadgen`, one request of the simulator). `live` is null
for a run that did not measure (its `error` says why) and for a ``--sim-only`` run. `sim_served`,
where the load's marsched servers learned their step costs, is `sim` at those costs
(`served_costs.py`); records.json's `served_costs` holds them per load and configuration.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "marsched.twin/1"
AGREEMENT = 0.15  # the bound on |live ÷ sim − 1| for the mean and the p99 (docs/twin.md)
TIE = 0.01  # simulated means closer than this rank either way


@dataclass(frozen=True, slots=True)
class Load:
    name: str  # light or queueing
    rate: float  # tasks per second


@dataclass(frozen=True, slots=True)
class TwinRecord:
    config: str
    load: Load
    repeat: int
    sim: dict[str, Any]
    live: dict[str, Any] | None
    error: str | None = None
    sim_served: dict[str, Any] | None = None  # `sim` at the step costs the live servers learned (`served_costs`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompt_tokens_ratio(report: dict[str, Any], contexts: dict[str, list[int]]) -> float | None:
    """The server's prompt tokens over the simulated contexts, summed over the turns it answered:
    1.0 when the filler text is a token a word on the served model, as the replay assumes."""
    served = simulated = 0
    for conversation in report.get("records") or ():
        planned = contexts.get(conversation["conversation"], [])
        for turn in conversation["turns"]:
            if turn.get("prompt_tokens") and turn["index"] < len(planned):
                served += turn["prompt_tokens"]
                simulated += planned[turn["index"]]
    return served / simulated if simulated else None


def live_numbers(report: dict[str, Any], contexts: dict[str, list[int]]) -> dict[str, Any]:
    """A loadgen report's per-task numbers (its conversations), with the turns' and errors, and how
    its prompts compare with the simulated contexts (`contexts`: task -> each call's)."""
    conversations = report.get("conversations") or {}
    turns = report.get("turns") or {}
    return {"e2e_mean_s": conversations.get("e2e_mean_s"), "e2e_p50_s": conversations.get("e2e_p50_s"),
            "e2e_p99_s": conversations.get("e2e_p99_s"), "tasks_finished": conversations.get("finished"),
            "turn_e2e_mean_s": turns.get("e2e_mean_s"), "turns_failed": turns.get("failed"),
            "prompt_tokens_ratio": prompt_tokens_ratio(report, contexts)}


def _ratio(live: float | None, sim: float | None) -> float | None:
    return live / sim if live is not None and sim else None


@dataclass(frozen=True, slots=True)
class Row:
    config: str
    load: str
    sim_mean_s: float
    sim_p99_s: float
    live_mean_s: list[float]  # one per measured repeat
    live_p99_s: list[float]

    @property
    def mean_ratio(self) -> float | None:
        return _ratio(statistics.median(self.live_mean_s), self.sim_mean_s) if self.live_mean_s else None

    @property
    def p99_ratio(self) -> float | None:
        return _ratio(statistics.median(self.live_p99_s), self.sim_p99_s) if self.live_p99_s else None


def rows(records: Sequence[TwinRecord], side: str = "sim") -> list[Row]:
    """One row per configuration and load, in the records' order, the live repeats together; `side`:
    the simulation set against them (`sim`, or `sim_served`; records without it are left out)."""
    grouped: dict[tuple[str, str], Row] = {}
    for record in records:
        sim = getattr(record, side)
        if sim is None:
            continue
        key = (record.config, record.load.name)
        row = grouped.setdefault(key, Row(record.config, record.load.name, sim["e2e_mean_s"], sim["e2e_p99_s"], [], []))
        if record.live and record.live.get("e2e_mean_s") is not None:
            row.live_mean_s.append(record.live["e2e_mean_s"])
            row.live_p99_s.append(record.live["e2e_p99_s"])
    return list(grouped.values())


@dataclass(frozen=True, slots=True)
class Swapped:
    """A pair of configurations the simulator ranks one way and the live medians the other."""

    sim_better: Row
    live_better: Row

    @property
    def within_spread(self) -> bool:
        """Whether the live repeats overlap (the slower one's best against the faster one's worst): their
        live order is then one the repeats do not settle."""
        return min(self.sim_better.live_mean_s) <= max(self.live_better.live_mean_s)

    def describe(self) -> str:
        spread = "live ranges overlap" if self.within_spread else "live ranges apart"
        return f"{self.live_better.config} before {self.sim_better.config} live, {spread}"


def swapped_pairs(load_rows: Sequence[Row]) -> list[Swapped] | None:
    """The pairs simulated and live means rank differently (None: a live one is missing): each pair
    the simulator tells apart by more than `TIE` that the live medians rank the other way. A pair it
    does not tell apart may come either way (the live difference is the machine's noise)."""
    if any(not row.live_mean_s for row in load_rows):
        return None
    return [Swapped(a, b) for a in load_rows for b in load_rows
            if a.sim_mean_s * (1 + TIE) < b.sim_mean_s
            and statistics.median(a.live_mean_s) > statistics.median(b.live_mean_s)]


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _live(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def _agrees(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return " ✓" if abs(ratio - 1) <= AGREEMENT else " ✗"


def _table(heading: str, load_rows: Sequence[Row]) -> list[str]:
    swapped = swapped_pairs(load_rows)
    order = "" if swapped is None else " (simulated and live rank the configurations alike)"
    if swapped:
        order = (" (simulated and live rank the configurations differently: "
                 + "; ".join(pair.describe() for pair in swapped) + ")")
    lines = [f"{heading}{order}", "",
             "| config | sim mean s | live mean s | live ÷ sim | sim p99 s | live p99 s | live ÷ sim |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in load_rows:
        lines.append(f"| {row.config} | {_s(row.sim_mean_s)} | {_live(row.live_mean_s)} | "
                     f"{_s(row.mean_ratio)}{_agrees(row.mean_ratio)} | {_s(row.sim_p99_s)} | "
                     f"{_live(row.live_p99_s)} | {_s(row.p99_ratio)}{_agrees(row.p99_ratio)} |")
    return lines + [""]


def _runs_of(source: str) -> str:
    return "every marsched run's" if source == "all" else f"{source}'s"


def markdown(records: Sequence[TwinRecord], served: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """Per load: each configuration's simulated and live mean and p99 per task, live as the median
    over repeats (min–max), and live ÷ sim (✓ within 15%); then, where the servers learned their step
    costs (`served`: load -> configuration -> `served_costs` terms), the same with the simulator at those costs."""
    table, served_table = rows(records), rows(records, "sim_served")
    lines = []
    for load in dict.fromkeys(row.load for row in table):
        rate = next(r.load.rate for r in records if r.load.name == load)
        lines += _table(f"### {load}: {rate:g} tasks/s", [row for row in table if row.load == load])
        load_served = [row for row in served_table if row.load == load]
        costs = (served or {}).get(load)
        if load_served and costs:
            ratios = [terms["step_time_ratio"] for terms in costs.values()]
            stand_ins = "; ".join(f"{config}'s from {_runs_of(terms['from_runs_of'])}" for config, terms in costs.items()
                                  if terms.get("from_runs_of") not in (None, config))
            # Runs from before the whole-run fit (`served_costs.run_step_terms`) give the fit their server decided with.
            without_run_fit = ", ".join(config for config, terms in costs.items()
                                        if terms.get("whole_run_fits", 0) < terms.get("runs", 0))
            lines += _table(f"#### {load}, simulated at the servers' step costs ({min(ratios):.2f}–{max(ratios):.2f}× the "
                            f"profile's step time; each configuration's own runs'" + (f", {stand_ins}" if stand_ins else "")
                            + (f"; the fit decided with, not the whole run's, for {without_run_fit}" if without_run_fit else "")
                            + ")", load_served)
    return "\n".join(lines).rstrip() + "\n"
