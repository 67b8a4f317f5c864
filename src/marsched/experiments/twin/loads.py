"""The loads the twin runs, picked by the simulator first: a light one, and one where requests queue.

Over a grid of rates, stock vLLM's twin (`vllm-stock`) is simulated, and each rate's mean task
latency is set against the same tasks' isolated latency (each alone on the engine):

- light: the highest rate whose mean is within `LIGHT_SLOWDOWN` of isolated (nothing waits much);
- queueing: the lowest rate whose mean is at least `QUEUEING_SLOWDOWN` × isolated (tasks wait
  for the engine a good part of their time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marsched.experiments.twin.records import Load

LIGHT_SLOWDOWN = 1.05
QUEUEING_SLOWDOWN = 1.5
PICKED_BY = "vllm-stock"


@dataclass(frozen=True, slots=True)
class SweepPoint:
    rate: float
    e2e_mean_s: float
    isolated_mean_s: float

    @property
    def slowdown(self) -> float:
        return self.e2e_mean_s / self.isolated_mean_s


def pick_loads(points: Sequence[SweepPoint]) -> tuple[Load, Load]:
    """(light, queueing) from a sweep, by the module's rule; ValueError when the grid has no such rate."""
    ordered = sorted(points, key=lambda p: p.rate)
    light = [p for p in ordered if p.slowdown <= LIGHT_SLOWDOWN]
    queueing = [p for p in ordered if p.slowdown >= QUEUEING_SLOWDOWN]
    sweep = ", ".join(f"{p.rate:g}/s: {p.slowdown:.2f}x" for p in ordered)
    if not light:
        raise ValueError(f"no rate of the grid is light (mean within {LIGHT_SLOWDOWN}x isolated): {sweep}; "
                         "add lower rates to --grid")
    if not queueing:
        raise ValueError(f"no rate of the grid queues (mean at least {QUEUEING_SLOWDOWN}x isolated): {sweep}; "
                         "add higher rates to --grid")
    return Load("light", light[-1].rate), Load("queueing", queueing[0].rate)


def sweep(rates: Sequence[float], simulate_at: Callable[[float], dict]) -> list[SweepPoint]:
    """`simulate_at(rate)` (a simulated summary) at every rate, as sweep points."""
    return [SweepPoint(rate, s["e2e_mean_s"], s["isolated_e2e_mean_s"]) for rate in rates
            for s in (simulate_at(rate),)]


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
