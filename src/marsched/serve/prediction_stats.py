"""What length prediction costs the requests of a running server.

The API server forwards a request at once and predicts its length alongside; the number follows
the request to the scheduler (`marsched.vllm.told_predictions`). Two times are kept per request:

- `added`: what prediction adds to the request's latency: reading its features on its path,
  and the time its response's first bytes wait for the number (it goes in a header), which is
  nothing unless they were ready first;
- `wait`: from reading the request to its number: the batch in flight, then its own batch. It is
  how late the scheduler may learn the number (`predictions_told_*` in the scheduler's state
  says whether it came in time to rank the request).

A batch's time is the model's alone, timed in its worker thread; the rest of a wait is queueing
and the API server's other work on the same interpreter. The most recent WINDOW of each are
kept. `/marsched/state` shows the summary under `prediction`, and `/metrics` shows it as the
`marsched_prediction_*` families.

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
        self.untold = 0  # made, but sending the number to the scheduler failed
        self.batches = 0
        self._added_s: deque[float] = deque(maxlen=window)
        self._waits_s: deque[float] = deque(maxlen=window)
        self._batch_sizes: deque[int] = deque(maxlen=window)
        self._batch_s: deque[float] = deque(maxlen=window)

    def waited(self, seconds: float) -> None:
        self._waits_s.append(seconds)

    def added(self, seconds: float) -> None:
        self._added_s.append(seconds)

    def batch(self, size: int, seconds: float) -> None:
        """A batch of `size` predictions ran, taking `seconds` in its worker thread."""
        self.batches += 1
        self._batch_sizes.append(size)
        self._batch_s.append(seconds)

    def summary(self) -> dict[str, Any]:
        waits_ms = np.asarray(self._waits_s) * 1e3
        sizes = np.asarray(self._batch_sizes)
        summary: dict[str, Any] = {"made": self.made, "failed": self.failed, "untold": self.untold,
                                   "batches": self.batches, "window": len(waits_ms)}
        for name, times in (("added", self._added_s), ("wait", self._waits_s)):
            if times:
                ms = np.asarray(times) * 1e3
                summary |= {f"{name}_p50_ms": round(float(np.percentile(ms, 50)), 3),
                            f"{name}_p99_ms": round(float(np.percentile(ms, 99)), 3),
                            f"{name}_max_ms": round(float(ms.max()), 3)}
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
