"""The engine's queue during a run: vLLM's `num_requests_waiting` and `num_requests_running` gauges
and its KV cache usage (`GET /metrics`, the same on stock vLLM and `marsched serve`), sampled on a
thread. It shows whether a load makes requests wait, which is what sets a light load apart from a
heavy one.
"""

from __future__ import annotations

import re
import statistics
import threading
from dataclasses import asdict, dataclass
from typing import Any

from marsched.experiments.conversations.servers import get

EVERY_S = 0.5
_GAUGES = {name: re.compile(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.eE+-]+)$", re.M)
           for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")}


@dataclass(frozen=True, slots=True)
class QueueStats:
    samples: int
    waiting_max: float | None
    waiting_mean: float | None
    waiting_share: float | None  # of the samples, those with a request waiting
    running_max: float | None
    kv_usage_max: float | None  # 0 to 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gauges(metrics_text: str) -> dict[str, float]:
    """The gauges (summed over engines) found in a /metrics page."""
    found = {}
    for name, pattern in _GAUGES.items():
        values = [float(v) for v in pattern.findall(metrics_text)]
        if values:
            found[name] = sum(values)
    return found


def queue_stats(samples: list[dict[str, float]]) -> QueueStats:
    def column(name: str) -> list[float]:
        return [s[name] for s in samples if name in s]

    waiting, running, usage = column("num_requests_waiting"), column("num_requests_running"), column(
        "kv_cache_usage_perc")
    return QueueStats(len(samples), max(waiting, default=None), statistics.fmean(waiting) if waiting else None,
                      sum(1 for w in waiting if w > 0) / len(waiting) if waiting else None,
                      max(running, default=None), max(usage, default=None))


class QueueSampler:
    """Samples `url`/metrics every EVERY_S from `start()` to `stop()`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[dict[str, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="http-bench-queue", daemon=True)

    def start(self) -> QueueSampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._done.wait(EVERY_S):
            page = get(f"{self.url}/metrics", timeout_s=2.0)
            if page is not None:
                self.samples.append(gauges(page.decode(errors="replace")))

    def stop(self) -> QueueStats:
        self._done.set()
        self._thread.join(timeout=5.0)
        return queue_stats(self.samples)
