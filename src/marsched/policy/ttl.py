"""Continuum's time-to-live for a program's KV after a tool call (arXiv 2511.02230).

After each tool call Continuum keeps ("pins") the program's KV on the device for a TTL, and
frees it if the next turn has not come by then. Two rules:

- `PaperTtl`, the paper's rule as the public plugin michiLXY03/vllm-continuum-plugin
  implements it (`src/continuum_vllm/policy.py`, `PaperTTLPolicy`): the TTL is
  τ* = argmax over τ of P(tool ≤ τ)·B − τ, with B = T·η + C_prefill(context), where
  - P is the empirical CDF of the tool's observed durations, or of every tool's while the
    tool has 100 samples or fewer (`history_threshold`); samples are kept in windows of 4,096;
  - the candidates are 0 and every observed duration; a tie keeps the shorter;
  - T is the mean queueing delay of the last 100 turns whose program had lost its KV
    (`SlidingWindowMean`, from 0);
  - η = −corr(k, N − k) over the turns k = 1..N of the programs that finished
    (`MemoryfulnessEstimator`; 1 before two samples or without variance);
  - C_prefill is the time to compute the context again; the plugin takes a constant (2 s)
    or a quadratic fit in the context, and here it is the engine's own cost model (Tfwd);
  - while every tool together has 100 samples or fewer, the TTL is 2 s (cold start).
- `FixedTtl`, the authors' public code (Hanchenli/vllm-continuum,
  `vllm/v1/core/estimate_with_func.py`, `ToolCallEstimator.set_up_pin`): 2 s if the tool's
  mean duration so far is at most 2 s (a tool never seen counts as 0 s), else no pin.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

COLD_START_TTL_S = 2.0
HISTORY_THRESHOLD = 100  # a tool's own CDF once it has more samples than this
MAX_SAMPLES = 4096
QUEUE_DELAY_WINDOW = 100
FIXED_PIN_S = 2.0


def best_ttl(sorted_samples: list[float], benefit_s: float) -> float:
    """τ* = argmax over τ in {0} ∪ samples of P(t ≤ τ)·benefit − τ, P the samples' empirical CDF;
    the first (shortest) τ wins a tie."""
    n = len(sorted_samples)
    if n == 0:
        return 0.0
    best_tau, best_utility = 0.0, bisect.bisect_right(sorted_samples, 0.0) / n * benefit_s
    for i, tau in enumerate(sorted_samples):
        if i + 1 < n and sorted_samples[i + 1] == tau:
            continue  # the CDF at τ counts every sample equal to it: take the last of a run
        utility = (i + 1) / n * benefit_s - tau
        if utility > best_utility:
            best_tau, best_utility = tau, utility
    return best_tau


def memoryfulness(pairs: int, sum_k: float, sum_r: float, sum_kk: float, sum_rr: float, sum_kr: float) -> float:
    """η = −corr(k, N − k) from running sums over the pairs; 1 with fewer than two or no variance."""
    if pairs < 2:
        return 1.0
    cov = sum_kr / pairs - (sum_k / pairs) * (sum_r / pairs)
    var_k = sum_kk / pairs - (sum_k / pairs) ** 2
    var_r = sum_rr / pairs - (sum_r / pairs) ** 2
    if var_k <= 0 or var_r <= 0:
        return 1.0
    return max(-1.0, min(1.0, -cov / math.sqrt(var_k * var_r)))


@dataclass(slots=True)
class PaperTtl:
    """The paper's TTL, learnt online from the run (see the module's docstring)."""

    prefill_s: Callable[[int], float]  # C_prefill: seconds to compute a context of this many tokens again
    name: str = "paper"
    _all: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    _by_tool: dict[str, deque[float]] = field(default_factory=dict)
    _seen_all: int = 0  # every sample ever observed (the cold start counts these)
    _seen_by_tool: dict[str, int] = field(default_factory=dict)
    _delays: deque[float] = field(default_factory=lambda: deque(maxlen=QUEUE_DELAY_WINDOW))
    _pairs: list[float] = field(default_factory=lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])  # n, Σk, Σr, Σk², Σr², Σkr

    def observe_call(self, tool: str, duration_s: float) -> None:
        duration_s = max(duration_s, 0.0)
        self._all.append(duration_s)
        self._by_tool.setdefault(tool, deque(maxlen=MAX_SAMPLES)).append(duration_s)
        self._seen_all += 1
        self._seen_by_tool[tool] = self._seen_by_tool.get(tool, 0) + 1

    def observe_queue_delay(self, seconds: float) -> None:
        self._delays.append(seconds)

    def observe_program(self, turns: int) -> None:
        pairs = self._pairs
        for k in range(1, turns + 1):
            r = turns - k
            pairs[0] += 1
            pairs[1] += k
            pairs[2] += r
            pairs[3] += k * k
            pairs[4] += r * r
            pairs[5] += k * r

    @property
    def queue_delay_s(self) -> float:
        return sum(self._delays) / len(self._delays) if self._delays else 0.0

    @property
    def eta(self) -> float:
        return memoryfulness(*self._pairs)

    def ttl_s(self, tool: str, context_tokens: int) -> float:
        if self._seen_all <= HISTORY_THRESHOLD:
            return COLD_START_TTL_S
        samples = self._by_tool[tool] if self._seen_by_tool.get(tool, 0) > HISTORY_THRESHOLD else self._all
        benefit = self.queue_delay_s * self.eta + self.prefill_s(context_tokens)
        return best_ttl(sorted(samples), benefit)


@dataclass(slots=True)
class FixedTtl:
    """The authors' public rule: pin 2 s after a tool whose mean duration is at most 2 s."""

    name: str = "fixed"
    _sums: dict[str, tuple[int, float]] = field(default_factory=dict)  # tool -> (calls, seconds)

    def observe_call(self, tool: str, duration_s: float) -> None:
        calls, seconds = self._sums.get(tool, (0, 0.0))
        self._sums[tool] = (calls + 1, seconds + duration_s)

    def observe_queue_delay(self, seconds: float) -> None:
        pass

    def observe_program(self, turns: int) -> None:
        pass

    def ttl_s(self, tool: str, context_tokens: int) -> float:
        calls, seconds = self._sums.get(tool, (0, 0.0))
        mean = seconds / calls if calls else 0.0
        return FIXED_PIN_S if mean <= FIXED_PIN_S else 0.0


@dataclass(slots=True)
class ConstantTtl:
    """Every call's KV pinned for `seconds`: `marsched serve --retention fixed:SECONDS` in the simulator."""

    seconds: float
    name: str = "constant"

    def observe_call(self, tool: str, duration_s: float) -> None:
        pass

    def observe_queue_delay(self, seconds: float) -> None:
        pass

    def observe_program(self, turns: int) -> None:
        pass

    def ttl_s(self, tool: str, context_tokens: int) -> float:
        return self.seconds
