"""A regime map's numbers: MARS over INFERCEPT per (qps, KV scale, API-time scale), and the
regime each point is in. Pure functions over metrics records; nothing here runs a simulation.

The regimes are read off measurements, not guessed from the load:

- **light**: every policy's mean end-to-end latency is within `light_excess` (10%) of the
  isolated floor (`isolated_e2e_mean_s`): nobody waits, no scheduler can win much.
- **overloaded**: INFERCEPT's longest queue wait exceeds `overload_wait_fraction` (10%) of
  the arrival window. A stable queue's longest wait does not grow with the run; an
  overloaded one grows with it (the run drains after the window, so late arrivals wait for
  the whole backlog). INFERCEPT is the yardstick because it is what a user runs today.
- **saturated**: in between: requests queue and memory binds, but the queue is bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

BASELINE = "infercept"
CANDIDATE = "mars"
POLICIES = (BASELINE, CANDIDATE)


class Regime(str, Enum):
    LIGHT = "light"
    SATURATED = "saturated"
    OVERLOADED = "overloaded"

    @property
    def letter(self) -> str:
        return self.value[0].upper()


@dataclass(frozen=True, slots=True)
class Thresholds:
    light_excess: float = 0.10  # mean e2e ≤ (1 + this) × the isolated floor, for every policy
    overload_wait_fraction: float = 0.10  # INFERCEPT's longest queue wait > this × the arrival window


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the map."""

    qps: float
    kv_scale: float
    api_time_scale: float
    mean_ratio: float  # MARS e2e mean / INFERCEPT e2e mean
    p99_ratio: float  # MARS e2e p99 / INFERCEPT e2e p99
    regime: Regime
    baseline_over_floor: float  # INFERCEPT's mean over the isolated floor
    candidate_over_floor: float
    baseline_max_wait_s: float
    candidate_max_wait_s: float

    def as_dict(self) -> dict:
        return {"qps": self.qps, "kv_scale": self.kv_scale, "api_time_scale": self.api_time_scale,
                "mean_ratio": self.mean_ratio, "p99_ratio": self.p99_ratio, "regime": self.regime.value,
                "infercept_over_floor": self.baseline_over_floor, "mars_over_floor": self.candidate_over_floor,
                "infercept_max_wait_s": self.baseline_max_wait_s, "mars_max_wait_s": self.candidate_max_wait_s}


def over_floor(record: dict) -> float:
    """Mean end-to-end latency over the isolated floor of the same requests (1.0: nobody waited)."""
    return record["e2e_mean_s"] / record["isolated_e2e_mean_s"]


def classify(baseline: dict, candidate: dict, thresholds: Thresholds = Thresholds()) -> Regime:
    """The regime of one point from its INFERCEPT and MARS records (see the module's docstring)."""
    if baseline["max_queue_wait_s"] > thresholds.overload_wait_fraction * baseline["duration_s"]:
        return Regime.OVERLOADED
    if all(over_floor(r) <= 1 + thresholds.light_excess for r in (baseline, candidate)):
        return Regime.LIGHT
    return Regime.SATURATED


def _key(record: dict) -> tuple[float, float, float]:
    return (record["qps"], record.get("kv_scale", 1.0), record.get("api_time_scale", 1.0))


def regime_cells(records: Iterable[dict], thresholds: Thresholds = Thresholds()) -> list[Cell]:
    """One cell per (qps, kv scale, API-time scale), sorted; each needs exactly one INFERCEPT and one
    MARS record (ValueError naming the point otherwise). Records of other policies are ignored."""
    points: dict[tuple[float, float, float], dict[str, dict]] = {}
    for record in records:
        if record["policy"] not in POLICIES:
            continue
        by_policy = points.setdefault(_key(record), {})
        if record["policy"] in by_policy:
            raise ValueError(f"two {record['policy']} records at {_describe(_key(record))}")
        by_policy[record["policy"]] = record
    cells = []
    for key in sorted(points):
        by_policy = points[key]
        missing = [p for p in POLICIES if p not in by_policy]
        if missing:
            raise ValueError(f"no {' or '.join(missing)} record at {_describe(key)}")
        base, cand = by_policy[BASELINE], by_policy[CANDIDATE]
        cells.append(Cell(*key, mean_ratio=cand["e2e_mean_s"] / base["e2e_mean_s"],
                          p99_ratio=cand["e2e_p99_s"] / base["e2e_p99_s"], regime=classify(base, cand, thresholds),
                          baseline_over_floor=over_floor(base), candidate_over_floor=over_floor(cand),
                          baseline_max_wait_s=base["max_queue_wait_s"], candidate_max_wait_s=cand["max_queue_wait_s"]))
    return cells


def _describe(key: tuple[float, float, float]) -> str:
    qps, kv, api = key
    return f"qps {qps:g}, kv scale {kv:g}, API-time scale {api:g}"


def distinct_values(text: str, values: list[float], flag: str) -> list[float]:
    """`values` (parsed from `text`) with no value given twice: a repeated axis value would draw a
    row or column twice. ValueError names the flag and the value."""
    seen: set[float] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{flag} {text!r}: {value:g} is given twice")
        seen.add(value)
    return sorted(values)


def text_table(cells: list[Cell]) -> str:
    """The map as text, one block per API-time scale: rows KV scale, columns qps, each cell
    'mean/p99 regime-letter'."""
    lines = []
    qps_values = sorted({c.qps for c in cells})
    for api in sorted({c.api_time_scale for c in cells}):
        lines.append(f"API time ×{api:g}: MARS/INFERCEPT mean / p99, regime (L light, S saturated, O overloaded)")
        lines.append("kv \\ qps  " + "".join(f"{q:>15g}" for q in qps_values))
        for kv in sorted({c.kv_scale for c in cells}, reverse=True):
            row = {c.qps: c for c in cells if c.api_time_scale == api and c.kv_scale == kv}
            text = "".join(f"{f'{row[q].mean_ratio:.2f}/{row[q].p99_ratio:.2f} {row[q].regime.letter}':>15}"
                           if q in row else f"{'-':>15}" for q in qps_values)
            lines.append(f"×{kv:<8g}" + text)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
