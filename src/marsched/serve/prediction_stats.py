"""What length prediction costs the requests of a running server.

A request's wait is the time the prediction middleware holds it: reading its features, waiting
for the batch in flight to end, and its own batch. It is what prediction adds to the request's
latency. A batch's time is the model's alone, timed in its worker thread; the rest of a wait is
queueing and the API server's other work on the same interpreter. The most recent WINDOW waits
and batch sizes are kept. `/marsched/state` shows the summary under `prediction`, and `/metrics`
shows it as the `marsched_prediction_*` families.

The middleware that predicts and the ones that answer `/marsched/state` and `/metrics` are
separate objects in the same API server process, so the predicting one publishes its stats here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

WINDOW = 10_000


class PredictionStats:
    """Counts of predictions made and failed, and the recent waits and batch sizes."""

    def __init__(self, window: int = WINDOW) -> None:
        self.made = 0
        self.failed = 0
        self.batches = 0
        self._waits_s: deque[float] = deque(maxlen=window)
        self._batch_sizes: deque[int] = deque(maxlen=window)
        self._batch_s: deque[float] = deque(maxlen=window)

    def waited(self, seconds: float) -> None:
        self._waits_s.append(seconds)

    def batch(self, size: int, seconds: float) -> None:
        """A batch of `size` predictions ran, taking `seconds` in its worker thread."""
        self.batches += 1
        self._batch_sizes.append(size)
        self._batch_s.append(seconds)

    def summary(self) -> dict[str, Any]:
        waits_ms = np.asarray(self._waits_s) * 1e3
        sizes = np.asarray(self._batch_sizes)
        summary: dict[str, Any] = {"made": self.made, "failed": self.failed, "batches": self.batches,
                                   "window": len(waits_ms)}
        if len(waits_ms):
            summary |= {"wait_p50_ms": round(float(np.percentile(waits_ms, 50)), 3),
                        "wait_p99_ms": round(float(np.percentile(waits_ms, 99)), 3),
                        "wait_max_ms": round(float(waits_ms.max()), 3)}
        if len(sizes):
            batch_ms = np.asarray(self._batch_s) * 1e3
            summary |= {"batch_mean": round(float(sizes.mean()), 2), "batch_max": int(sizes.max()),
                        "batch_p50_ms": round(float(np.percentile(batch_ms, 50)), 3),
                        "batch_p99_ms": round(float(np.percentile(batch_ms, 99)), 3)}
        return summary


_published: PredictionStats | None = None


def publish(stats: PredictionStats) -> None:
    """Make `stats` the ones this process's state and metrics show."""
    global _published
    _published = stats


def published() -> PredictionStats | None:
    """The stats of this process's prediction middleware; None when it does not predict."""
    return _published
