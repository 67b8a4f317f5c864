"""The loads the twin runs, picked by the simulator first: a light one, and one where requests queue.

Over a grid of rates every configuration's twin is simulated, and each rate's mean task latency
is set against the same tasks' isolated latency (each alone on the engine, kept whole across its
calls). Some configurations are slower than that even alone (stock vLLM ends a request at every
call and finds only part of it in the prefix cache), so a configuration's slowdown is taken
relative to its least on the grid, its unloaded engine's:

- light: the highest rate at which every configuration is within `LIGHT_SLOWDOWN` of its
  unloaded slowdown (nothing waits much, whatever the scheduler);
- queueing: the lowest rate at which every configuration is at `QUEUEING_SLOWDOWN` × its
  unloaded slowdown or more (tasks wait for the engine a good part of their time under every
  scheduler, so the order matters, not only what is kept between calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marsched.experiments.twin.records import Load

LIGHT_SLOWDOWN = 1.05
QUEUEING_SLOWDOWN = 1.5


@dataclass(frozen=True, slots=True)
class SweepPoint:
    config: str
    rate: float
    e2e_mean_s: float
    isolated_mean_s: float

    @property
    def slowdown(self) -> float:
        return self.e2e_mean_s / self.isolated_mean_s


def relative_slowdowns(points: Sequence[SweepPoint]) -> dict[float, dict[str, float]]:
    """rate -> configuration -> its slowdown over its least on the grid."""
    least: dict[str, float] = {}
    for point in points:
        least[point.config] = min(least.get(point.config, point.slowdown), point.slowdown)
    by_rate: dict[float, dict[str, float]] = {}
    for point in sorted(points, key=lambda p: p.rate):
        by_rate.setdefault(point.rate, {})[point.config] = point.slowdown / least[point.config]
    return by_rate


def pick_loads(points: Sequence[SweepPoint]) -> tuple[Load, Load]:
    """(light, queueing) from a sweep, by the module's rule; ValueError when the grid has no such rate."""
    by_rate = relative_slowdowns(points)
    rates = list(by_rate)
    light = [r for r in rates if max(by_rate[r].values()) <= LIGHT_SLOWDOWN]
    queueing = [r for r in rates if min(by_rate[r].values()) >= QUEUEING_SLOWDOWN]
    sweep = ", ".join(f"{r:g}/s: {min(by_rate[r].values()):.2f}-{max(by_rate[r].values()):.2f}x" for r in rates)
    if not light:
        raise ValueError(f"no rate of the grid is light (every slowdown within {LIGHT_SLOWDOWN}x its least): "
                         f"{sweep}; add lower rates to --grid")
    if not queueing:
        raise ValueError(f"no rate of the grid queues (every slowdown at least {QUEUEING_SLOWDOWN}x its least): "
                         f"{sweep}; add higher rates to --grid")
    return Load("light", light[-1]), Load("queueing", queueing[0])


def sweep(configs: Sequence[str], rates: Sequence[float],
          simulate_at: Callable[[str, float], dict]) -> list[SweepPoint]:
    """`simulate_at(config, rate)` (a simulated summary) for every configuration and rate."""
    return [SweepPoint(config, rate, s["e2e_mean_s"], s["isolated_e2e_mean_s"]) for config in configs
            for rate in rates for s in (simulate_at(config, rate),)]


def parse_loads(text: str) -> tuple[Load, ...]:
    """``light:0.05,queueing:0.4`` as loads; ValueError naming the bad part."""
    loads = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, rate = part.partition(":")
        try:
            value = float(rate)
        except ValueError:
            value = float("nan")
        if not sep or not name or not value > 0 or value == float("inf"):
            raise ValueError(f"--loads: {part!r} is not NAME:RATE with a rate > 0 (for example light:0.05)")
        loads.append(Load(name, value))
    if not loads:
        raise ValueError("--loads: give NAME:RATE pairs, or 'auto' to pick them with the simulator")
    if len({load.name for load in loads}) != len(loads):
        raise ValueError(f"--loads {text}: a name is given twice")
    return tuple(loads)
