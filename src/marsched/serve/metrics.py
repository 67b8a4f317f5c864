"""`GET /metrics` with the MARS scheduler's state appended to vLLM's Prometheus metrics.

Loaded into vLLM's API server with `--middleware marsched.serve.metrics.MarsMetricsMiddleware`
(an ASGI middleware, like `state.py`). On `GET /metrics` it lets vLLM answer, keeps vLLM's
text, asks every rank's workers for `mars_state` (`state.ask_ranks`, the same question
`/marsched/state` asks) and appends the `marsched_*` families below, rendered by
prometheus_client from a fresh registry so that names, types and escaping are its own.
Every series has a `rank` label: the data-parallel rank (vLLM's `engine` label), 0 without
data parallelism.

vLLM is asked for the plain text format (the scrape's `Accept` and `Accept-Encoding` are
not passed on): the OpenMetrics format ends with `# EOF` and a gzipped body cannot be
appended to. An answer that is not a plain-text 200 is passed on untouched.

When the engine does not answer within METRICS_TIMEOUT_S, the scrape still gets vLLM's
metrics, plus `marsched_state_up 0` for each rank, so a slow engine costs one scrape's marsched part,
not the scrape.

When the API server predicts lengths, `marsched_predictions_total`,
`marsched_prediction_failures_total`, `marsched_prediction_added_seconds` and
`marsched_prediction_wait_seconds` (p50 and p99 over the recent requests, `prediction_stats.py`)
come first, without a rank label.

Keys the scheduler does not report (the retention counters before conversation KV
retention, for instance) read 0: a series that exists from the first scrape is easier to
graph and alert on than one that appears later.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from marsched.serve.prediction_stats import published
from marsched.serve.state import EngineUnavailable, ask_ranks, rank_count

PATHS = ("/metrics", "/metrics/")  # vLLM mounts its exporter at ^/metrics(.*)$
METRICS_TIMEOUT_S = 3.0  # well under Prometheus's default 10 s scrape timeout
NOT_PASSED_ON = {b"accept", b"accept-encoding"}

# (metric name, scheduler key, help): one series each.
GAUGES = (
    ("marsched_waiting_requests", "waiting", "Requests in the MARS scheduler's waiting queue."),
    ("marsched_running_requests", "running", "Requests in the running batch."),
    ("marsched_device_free_blocks", "device_free_blocks", "Free KV blocks on the device."),
    ("marsched_device_total_blocks", "device_total_blocks", "KV blocks on the device (the null block excluded)."),
    ("marsched_predicted_memory_time_in_flight", "memory_time_in_flight",
     "Predicted KV memory x time (token-seconds) the requests in the engine will still hold: the MARS "
     "ranking key summed over them, a load signal for a router (recomputed every 0.5 s or less often)."),
)
COUNTERS = (
    ("marsched_promotions_total", "promotions", "Requests promoted by starvation prevention."),
    ("marsched_retention_hits_total", "retention_hits",
     "Conversation turns that found their previous turn's KV retained."),
    ("marsched_retention_misses_total", "retention_misses",
     "Conversation turns whose previous turn's KV was not retained (discarded, expired or never kept)."),
    ("marsched_retention_expired_total", "retention_expired",
     "Retained conversations released because their time limit passed."),
    ("marsched_retention_yielded_total", "retention_yielded",
     "Follow-ups whose retained KV went back to the prefix cache, unpinned, while they waited behind a "
     "request that needed the room."),
    ("marsched_retention_reused_tokens_total", "retention_reused_tokens",
     "Prompt tokens served from retained conversation KV instead of recomputed."),
    ("marsched_follow_ups_matched_total", "follow_ups_matched",
     "Requests naming no conversation recognised as a follow-up of one by their prompt's block hashes."),
    ("marsched_follow_ups_ambiguous_total", "follow_ups_ambiguous",
     "Requests naming no conversation whose prompt continues several conversations alike: none matched."),
    ("marsched_predictions_told_on_arrival_total", "predictions_told_on_arrival",
     "Requests whose predicted length the API server told before they reached the scheduler."),
    ("marsched_predictions_told_while_waiting_total", "predictions_told_while_waiting",
     "Requests whose predicted length came while they waited, never admitted: ranked anew."),
    ("marsched_predictions_told_late_total", "predictions_told_late",
     "Requests whose predicted length came after their admission: ranked by their plan's length."),
)
# (metric name, help, {strategy label: scheduler key}): one series per strategy.
BY_STRATEGY = (
    ("marsched_retained_conversations", "Conversations whose KV is retained between turns, by strategy.",
     {"preserve": "retained_preserve", "swap": "retained_swap"}),
    ("marsched_paused_requests", "Requests paused for a tool call, by the strategy of their KV.",
     {"preserve": "paused_preserve", "swap": "paused_swap", "discard": "paused_discard"}),
)


@dataclass(frozen=True, slots=True)
class MarsSnapshot:
    """What one scrape learned from the engine: nothing (it did not answer) or its state."""

    answered: bool
    scheduler: dict[str, Any] = field(default_factory=dict)
    host_bytes: int = 0

    @classmethod
    def from_workers(cls, workers: list[dict[str, Any]] | None) -> MarsSnapshot:
        if not workers:
            return cls(answered=False)
        # Every tensor-parallel rank reports the same scheduler; each holds its own share
        # of the host copies.
        scheduler = next((w["scheduler"] for w in workers if isinstance(w.get("scheduler"), dict)), None)
        if scheduler is None:
            return cls(answered=False)
        return cls(answered=True, scheduler=scheduler, host_bytes=sum(int(w.get("host_bytes") or 0) for w in workers))

    def number(self, key: str) -> float:
        value = self.scheduler.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class MarsCollector:
    """A prometheus_client collector over one snapshot per rank (fresh ones per scrape), and the
    API server's prediction stats (`prediction_stats.summary()`, when it predicts)."""

    def __init__(self, snapshots: list[MarsSnapshot], prediction: dict[str, Any] | None = None) -> None:
        self.snapshots = snapshots
        self.prediction = prediction

    def collect(self) -> Iterator[Metric]:
        yield from _prediction_families(self.prediction)
        ranks = [(str(rank), snap) for rank, snap in enumerate(self.snapshots)]
        up = GaugeMetricFamily("marsched_state_up", "1 if the MARS scheduler answered this scrape, else 0.",
                               labels=["rank"])
        for rank, snap in ranks:
            up.add_metric([rank], 1.0 if snap.answered else 0.0)
        yield up
        ranks = [(rank, snap) for rank, snap in ranks if snap.answered]
        if not ranks:
            return
        family = GaugeMetricFamily("marsched_host_kv_bytes", "Bytes of KV the Swap connector holds in host memory.",
                                   labels=["rank"])
        for rank, snap in ranks:
            family.add_metric([rank], float(snap.host_bytes))
        yield family
        for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, key, help_text in table:
                family = kind(name, help_text, labels=["rank"])
                for rank, snap in ranks:
                    family.add_metric([rank], snap.number(key))
                yield family
        for name, help_text, keys in BY_STRATEGY:
            family = GaugeMetricFamily(name, help_text, labels=["rank", "strategy"])
            for rank, snap in ranks:
                for strategy, key in keys.items():
                    family.add_metric([rank, strategy], snap.number(key))
            yield family
        yield from _cost_families(ranks)


# The cost model's iteration terms (`/marsched/state` `cost_model`), by the `term` label.
COST_TERMS = {"iteration": "seconds_per_iteration", "token": "seconds_per_token",
              "context_token": "seconds_per_context_token", "sequence": "seconds_per_sequence",
              "attention_pair": "seconds_per_attention_pair"}


def _cost_families(ranks: list[tuple[str, MarsSnapshot]]) -> Iterator[Metric]:
    """The cost model each rank decides with, and where it comes from (`policy/learned_cost.py`)."""
    costs = [(rank, snap.scheduler["cost_model"]) for rank, snap in ranks
             if isinstance(snap.scheduler.get("cost_model"), dict)]
    if not costs:
        return
    terms = GaugeMetricFamily("marsched_cost_model_seconds", "The scheduler's cost model: seconds per iteration, "
                              "per token, per context token, per sequence, per attention pair (term), and where "
                              "they come from (source: learned, placeholder, configured, profile).",
                              labels=["rank", "term", "source"])
    swap = GaugeMetricFamily("marsched_cost_model_swap_tokens_per_second",
                             "The host link's rate in the scheduler's cost model, and where it comes from.",
                             labels=["rank", "source"])
    steps = CounterMetricFamily("marsched_cost_model_steps_total", "Steps timed to learn the cost model.",
                                labels=["rank"])
    for rank, cost in costs:
        for term, key in COST_TERMS.items():
            terms.add_metric([rank, term, str(cost.get("step_source"))], float(cost.get(key) or 0.0))
        swap.add_metric([rank, str(cost.get("swap_source"))], float(cost.get("swap_tokens_per_s") or 0.0))
        steps.add_metric([rank], float(cost.get("steps") or 0))
    yield from (terms, swap, steps)


def _prediction_families(summary: dict[str, Any] | None) -> Iterator[Metric]:
    """The API server's prediction counts and recent waits: no rank label, the front end predicts
    for every rank."""
    if summary is None:
        return
    yield CounterMetricFamily("marsched_predictions_total", "Requests whose output length the API server predicted.",
                              value=summary["made"])
    yield CounterMetricFamily("marsched_prediction_failures_total",
                              "Requests that went on unpredicted because the length model failed.",
                              value=summary["failed"])
    for name, text in (("added", "What predicting its length added to a request's latency (reading its features, "
                                  "and its first bytes waiting for the number), over the most recent requests."),
                       ("wait", "From reading a request to its predicted length (the batch queue, the model), "
                                "over the most recent requests; the request does not wait for it.")):
        family = GaugeMetricFamily(f"marsched_prediction_{name}_seconds", text, labels=["quantile"])
        for quantile, key in (("0.5", f"{name}_p50_ms"), ("0.99", f"{name}_p99_ms")):
            if key in summary:
                family.add_metric([quantile], summary[key] / 1e3)
        yield family


def render(snapshots: list[MarsSnapshot], prediction: dict[str, Any] | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MarsCollector(snapshots, prediction))
    return generate_latest(registry)


class MarsMetricsMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") not in PATHS or scope.get("method") != "GET":
            await self.app(scope, receive, send)
            return
        answer = _CapturedAnswer()
        plain = dict(scope, headers=[(k, v) for k, v in scope.get("headers", []) if k.lower() not in NOT_PASSED_ON])
        await self.app(plain, receive, answer.send)
        if not answer.appendable():
            await answer.replay(send)
            return
        try:
            snapshots = [MarsSnapshot.from_workers(w) for w in await ask_ranks(scope, timeout_s=METRICS_TIMEOUT_S)]
        except EngineUnavailable:
            snapshots = [MarsSnapshot(answered=False)] * rank_count(scope)
        stats = published()
        await answer.replay(send, render(snapshots, stats.summary() if stats is not None else None))


class _CapturedAnswer:
    """The downstream app's response, held back so that it can be extended."""

    def __init__(self) -> None:
        self.start: dict[str, Any] | None = None
        self.body = bytearray()
        self.others: list[dict[str, Any]] = []  # e.g. trailers: passed on after the body

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.start = message
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
        else:
            self.others.append(message)

    def header(self, name: bytes) -> bytes | None:
        for key, value in (self.start or {}).get("headers", []):
            if key.lower() == name:
                return value
        return None

    def appendable(self) -> bool:
        return (self.start is not None and self.start.get("status") == 200
                and self.header(b"content-encoding") is None
                and (self.header(b"content-type") or b"").startswith(b"text/plain"))

    async def replay(self, send: Any, extra: bytes = b"") -> None:
        if self.start is None:  # the app sent nothing; nothing to pass on
            return
        body = bytes(self.body)
        if extra:
            body = body + (b"" if not body or body.endswith(b"\n") else b"\n") + extra
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**self.start, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        for message in self.others:
            await send(message)
