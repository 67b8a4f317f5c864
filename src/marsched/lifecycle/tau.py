"""τ: the engine's time per iteration as the ranking keys see it, a moving average over about
100 iterations. One estimate for both engines: each feeds it the cost model's time for every
iteration it schedules (the keys' other terms are in the cost model's seconds too)."""

from __future__ import annotations

from marsched.policy.cost_model import CostModel

KEEP = 0.99  # weight of the old estimate per iteration: about 100 iterations of memory


def moving_average(tau: float, first: float, growth: float, iterations: int) -> float:
    """τ after `iterations` updates `τ ← k·τ + (1−k)·dt_i` with `dt_i = first + i·growth`, in closed form."""
    decay = KEEP**iterations
    tau += (first - tau) * (1 - decay)
    if growth and iterations > 1:
        # The growth's share: (1−k)·Σ_i i·k^(N−1−i) = (N − 1) − k·(1 − k^(N−1))/(1 − k).
        tau += growth * ((iterations - 1) - KEEP * (1 - KEEP ** (iterations - 1)) / (1 - KEEP))
    return tau


class IterationTime:
    """The estimate, starting from the cost model's one-token, one-sequence iteration (one context
    token read, one attention pair)."""

    __slots__ = ("seconds",)

    def __init__(self, cost: CostModel) -> None:
        self.seconds = cost.iteration_time(1, 1, 1, 1)

    def observe(self, first_s: float, growth_s: float = 0.0, iterations: int = 1) -> None:
        """`iterations` iterations ran, the first taking `first_s`, each next `growth_s` longer."""
        self.seconds = moving_average(self.seconds, first_s, growth_s, iterations)
