"""Per-request outcomes and the summary metrics every report is built from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    api_time_s: float
    prompt_tokens: int
    output_tokens: int
    api_return_tokens: int
    preemptions: int
    max_wait_s: float  # longest single stay in the queue
    isolated_e2e_s: float  # alone on the engine: no queueing, no preemption
    strategies: tuple[str, ...]  # the strategy each call ran under

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def norm_latency_s_per_token(self) -> float:
        """INFERCEPT's normalized latency: time outside API calls per token, API-returned tokens included."""
        return (self.e2e_s - self.api_time_s) / max(self.output_tokens + self.api_return_tokens, 1)


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def summarize(records: list[RequestRecord]) -> dict[str, float | int | dict[str, int]]:
    """Latency, throughput and strategy metrics over finished requests."""
    if not records:
        raise ValueError("no finished requests to summarize")
    e2e = np.array([r.e2e_s for r in records])
    ttft = np.array([r.ttft_s for r in records])
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s for r in records)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in records)
    strategy_counts: dict[str, int] = {}
    for record in records:
        for strategy in record.strategies:
            strategy_counts[strategy] = strategy_counts.get(strategy, 0) + 1
    return {
        "num_finished": len(records),
        "e2e_mean_s": float(e2e.mean()),
        "e2e_p50_s": _percentile(e2e, 50),
        "e2e_p99_s": _percentile(e2e, 99),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "norm_latency_mean_s_per_token": float(np.mean([r.norm_latency_s_per_token for r in records])),
        "throughput_tokens_per_s": tokens / (end - start) if end > start else float("nan"),
        "max_queue_wait_s": max(r.max_wait_s for r in records),
        "preemptions": sum(r.preemptions for r in records),
        "strategy_counts": dict(sorted(strategy_counts.items())),
        "isolated_e2e_mean_s": float(np.mean([r.isolated_e2e_s for r in records])),
        **slowdowns(e2e, np.array([r.isolated_e2e_s for r in records])),
        # The distributions, as the 0th to 100th percentiles: what `marsched plot --metrics` draws CDFs from.
        "e2e_cdf_s": _cdf(e2e),
        "ttft_cdf_s": _cdf(ttft),
    }


# Size buckets for the mean slowdown, by a request's isolated latency (its size alone on the
# engine): the smaller half, the next 40%, the next 9%, the largest 1%.
SIZE_BUCKETS = ((0, 50), (50, 90), (90, 99), (99, 100))


def slowdowns(e2e: np.ndarray, isolated: np.ndarray) -> dict[str, float | dict[str, float]]:
    """Slowdown (e2e ÷ isolated latency: what the scheduler did to each request, whatever its
    size) as mean, p99 and max, and its mean per size bucket (`SIZE_BUCKETS`)."""
    slowdown = e2e / np.maximum(isolated, 1e-12)
    order = np.argsort(isolated, kind="stable")
    by_size = {}
    for low, high in SIZE_BUCKETS:
        chosen = order[int(len(order) * low / 100):max(int(len(order) * high / 100), int(len(order) * low / 100) + 1)]
        by_size[f"p{low}-{high}"] = float(slowdown[chosen].mean())
    return {"slowdown_mean": float(slowdown.mean()), "slowdown_p99": _percentile(slowdown, 99),
            "slowdown_max": float(slowdown.max()), "slowdown_mean_by_size": by_size}


def _cdf(values: np.ndarray) -> list[float]:
    return [round(float(v), 6) for v in np.percentile(values, np.arange(101))]
