"""`GET /metrics` of `marsched serve`: vLLM's metrics with the MARS scheduler's appended.

The middleware alone first (a fake vLLM app and engine: what is appended, what is passed
on untouched, a silent engine), then the session's chat server on the tiny model (`servers.CHAT`, shared
with test_serve.py): the text parses with prometheus_client's own parser, vLLM's families are
still there, and the marsched gauges follow the scheduler while requests run.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsched.serve.metrics import MarsMetricsMiddleware, MarsSnapshot, render

R0 = (("rank", "0"),)  # every marsched series is labelled with its data-parallel rank
VLLM_TEXT = b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} over every family, parsed as Prometheus parses it."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- the middleware alone -----------------------------------------------------------------------


class FakeEngine:
    def __init__(self, workers=None, error: Exception | None = None, delay_s: float = 0.0) -> None:
        self.workers, self.error, self.delay_s = workers, error, delay_s

    async def collective_rpc(self, method, args=()):
        assert method == "mars_state"
        await asyncio.sleep(self.delay_s)
        if self.error:
            raise self.error
        return self.workers


def fake_vllm(body: bytes = VLLM_TEXT, content_type: bytes = b"text/plain; version=0.0.4; charset=utf-8",
              status: int = 200, gzipped: bool = False):
    seen: list[dict] = []

    async def app(scope, receive, send):
        seen.append(scope)
        data = gzip.compress(body) if gzipped else body
        headers = [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]
        if gzipped:
            headers.append((b"content-encoding", b"gzip"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app, seen


def scrape(app, engine, path="/metrics", method="GET", headers=()):
    messages: list[dict] = []

    async def send(message):
        messages.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": path, "method": method, "headers": list(headers),
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}
    asyncio.run(MarsMetricsMiddleware(app)(scope, receive, send))
    start = messages[0]
    body = b"".join(m.get("body", b"") for m in messages[1:])
    return start, body


def header(start, name: bytes) -> bytes | None:
    return next((v for k, v in start["headers"] if k == name), None)


STATE = {"host_bytes": 4096, "scheduler": {
    "running": 2, "waiting": 3, "paused": 1, "device_free_blocks": 10, "device_total_blocks": 40,
    "retained_preserve": 4, "retained_swap": 1, "paused_discard": 1, "promotions": 7,
    "retention_hits": 5, "retention_misses": 2, "retention_expired": 1, "retention_reused_tokens": 1234,
    "predictions_told_on_arrival": 11, "predictions_told_while_waiting": 6, "predictions_told_late": 2}}


def test_appends_marsched_families_after_vllms_and_fixes_the_length():
    app, seen = fake_vllm()
    start, body = scrape(app, FakeEngine([STATE]), headers=[(b"accept-encoding", b"gzip"),
                                                            (b"accept", b"application/openmetrics-text")])
    assert start["status"] == 200 and int(header(start, b"content-length")) == len(body)
    assert body.startswith(VLLM_TEXT)
    names = {h[0] for h in seen[0]["headers"]}
    assert b"accept-encoding" not in names and b"accept" not in names  # vLLM answers plain text
    values = samples(body.decode())
    assert values[("vllm:num_requests_running", ())] == 0
    assert values[("marsched_state_up", R0)] == 1
    assert values[("marsched_host_kv_bytes", R0)] == 4096
    assert values[("marsched_running_requests", R0)] == 2 and values[("marsched_waiting_requests", R0)] == 3
    assert values[("marsched_device_free_blocks", R0)] == 10
    assert values[("marsched_retained_conversations", R0 + (("strategy", "preserve"),))] == 4
    assert values[("marsched_retained_conversations", R0 + (("strategy", "swap"),))] == 1
    assert values[("marsched_paused_requests", R0 + (("strategy", "discard"),))] == 1
    assert values[("marsched_paused_requests", R0 + (("strategy", "swap"),))] == 0  # absent key: 0
    assert values[("marsched_promotions_total", R0)] == 7
    assert values[("marsched_retention_reused_tokens_total", R0)] == 1234
    assert [values[(f"marsched_predictions_told_{when}_total", R0)] for when in ("on_arrival", "while_waiting", "late")] \
        == [11, 6, 2]
    types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert types["marsched_retention_hits"] == "counter" and types["marsched_running_requests"] == "gauge"


def test_a_scheduler_without_retention_keys_reads_zero():
    text = render([MarsSnapshot.from_workers([{"host_bytes": 0, "scheduler": {"running": 1}}])]).decode()
    values = samples(text)
    assert values[("marsched_running_requests", R0)] == 1
    assert values[("marsched_retention_misses_total", R0)] == 0
    assert values[("marsched_retained_conversations", R0 + (("strategy", "preserve"),))] == 0


def test_the_api_servers_prediction_stats_come_without_a_rank_label():
    prediction = {"made": 12, "failed": 1, "batches": 5, "window": 12, "wait_p50_ms": 2.0, "wait_p99_ms": 8.5,
                  "added_p50_ms": 0.1, "added_p99_ms": 0.7}
    values = samples(render([MarsSnapshot(answered=False)], prediction).decode())
    assert values[("marsched_predictions_total", ())] == 12
    assert values[("marsched_prediction_failures_total", ())] == 1
    assert values[("marsched_prediction_wait_seconds", (("quantile", "0.5"),))] == pytest.approx(0.002)
    assert values[("marsched_prediction_wait_seconds", (("quantile", "0.99"),))] == pytest.approx(0.0085)
    assert values[("marsched_prediction_added_seconds", (("quantile", "0.5"),))] == pytest.approx(0.0001)
    assert values[("marsched_prediction_added_seconds", (("quantile", "0.99"),))] == pytest.approx(0.0007)
    assert values[("marsched_state_up", R0)] == 0  # the engine's part is on its own
    assert ("marsched_predictions_total", ()) not in samples(render([MarsSnapshot(answered=False)]).decode())


def test_tensor_parallel_workers_add_their_host_bytes():
    snapshot = MarsSnapshot.from_workers([STATE, {"host_bytes": 100, "scheduler": STATE["scheduler"]}])
    assert snapshot.host_bytes == 4196 and snapshot.scheduler["running"] == 2


@pytest.mark.parametrize("engine", [None, FakeEngine(error=RuntimeError("EngineDeadError")),
                                    FakeEngine([{"host_bytes": 0}])])
def test_an_engine_that_does_not_answer_leaves_vllms_metrics_and_state_up_0(engine):
    start, body = scrape(fake_vllm()[0], engine)
    assert start["status"] == 200 and body.startswith(VLLM_TEXT)
    values = samples(body.decode())
    assert values[("marsched_state_up", R0)] == 0
    assert not any(name.startswith("marsched_") and name != "marsched_state_up" for name, _ in values)


def test_a_slow_engine_costs_the_marsched_part_only(monkeypatch):
    monkeypatch.setattr("marsched.serve.metrics.METRICS_TIMEOUT_S", 0.05)
    started = time.monotonic()
    _, body = scrape(fake_vllm()[0], FakeEngine([STATE], delay_s=5))
    assert time.monotonic() - started < 2
    assert samples(body.decode())[("marsched_state_up", R0)] == 0


@pytest.mark.parametrize("kind", ["gzip", "error", "json", "head", "other-path"])
def test_other_answers_and_requests_pass_untouched(kind):
    app, _ = fake_vllm(gzipped=kind == "gzip", status=500 if kind == "error" else 200,
                       content_type=b"application/json" if kind == "json" else b"text/plain; version=0.0.4")
    start, body = scrape(app, FakeEngine([STATE]), method="HEAD" if kind == "head" else "GET",
                         path="/v1/models" if kind == "other-path" else "/metrics")
    assert b"marsched_" not in (gzip.decompress(body) if kind == "gzip" else body)
    assert int(header(start, b"content-length")) == len(body)


# --- a live server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


def live_samples(server) -> dict[tuple[str, tuple], float]:
    response = server.client.get(server.url + "/metrics", headers={"accept-encoding": "gzip"})
    assert response.status_code == 200, response.text
    return samples(response.text)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_live_metrics_follow_the_scheduler(server):
    from servers import completion, wait_idle

    idle = live_samples(server)
    assert any(name == "vllm:kv_cache_usage_perc" for name, _ in idle)  # vLLM's own families are kept
    assert idle[("marsched_state_up", R0)] == 1
    assert idle[("marsched_running_requests", R0)] == 0 and idle[("marsched_waiting_requests", R0)] == 0
    total = idle[("marsched_device_total_blocks", R0)]
    assert total > 0 and idle[("marsched_device_free_blocks", R0)] == total
    state = server.state()["scheduler"]
    assert state["device_total_blocks"] == total  # the same question /marsched/state asks

    # Long requests (ignore_eos) running while we scrape: the gauges must move. A scrape asks the
    # engine with a time limit, and on a loaded machine four requests can end within the first
    # few scrapes: up to five rounds of them, until a scrape has seen one running.
    busiest = idle
    for round_index in range(5):
        responses: list = []

        def run(index: int) -> None:
            rid = f"metrics-{round_index}-{index}"
            body = completion(server, max_tokens=400, ignore_eos=True,
                              vllm_xargs={"marsched": json.dumps({"strategy": "swap", "rid": rid})})
            responses.append(server.post("/v1/completions", body))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            current = live_samples(server)
            # A scrape the engine did not answer in time has `marsched_state_up 0` and no gauges.
            if current[("marsched_state_up", R0)] == 1 and \
                    current[("marsched_running_requests", R0)] > busiest[("marsched_running_requests", R0)]:
                busiest = current
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        if busiest[("marsched_running_requests", R0)] >= 1:
            break
    assert busiest[("marsched_running_requests", R0)] >= 1, "never saw a running request"
    assert busiest[("marsched_device_free_blocks", R0)] < total
    assert idle[("marsched_predicted_memory_time_in_flight", R0)] == 0
    assert busiest[("marsched_predicted_memory_time_in_flight", R0)] > 0  # the running requests' keys
    wait_idle(server)
    after = live_samples(server)
    assert after[("marsched_running_requests", R0)] == 0 and after[("marsched_device_free_blocks", R0)] == total
    assert after[("marsched_predicted_memory_time_in_flight", R0)] == 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_live_retained_conversation_is_counted(server):
    """A conversation turn with a forced strategy is retained; the next turn is a hit."""
    from servers import completion

    def turn(**marsched) -> object:
        body = completion(server, max_tokens=4, prompt="the quick brown fox jumps over the lazy dog " * 20,
                          vllm_xargs={"marsched": json.dumps(marsched)})
        return server.post("/v1/completions", body)

    first = turn(conversation="metrics-conv", tool_s=5, strategy="preserve")
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 10
    while live_samples(server)[("marsched_retained_conversations", R0 + (("strategy", "preserve"),))] < 1:
        assert time.monotonic() < deadline, "the retained conversation never showed"
        time.sleep(0.1)
    hits = live_samples(server)[("marsched_retention_hits_total", R0)]
    assert turn(conversation="metrics-conv", tool_s=0, retain=False).status_code == 200
    after = live_samples(server)
    assert after[("marsched_retention_hits_total", R0)] == hits + 1
    assert after[("marsched_retention_reused_tokens_total", R0)] > 0


class FakeDataParallelEngine:
    """An engine client over two data-parallel ranks: each rank's engine core answers for itself."""

    def __init__(self, ranks) -> None:
        self.ranks = ranks
        self.engine_core = SimpleNamespace(core_engines=[b"\x00\x00", b"\x01\x00"],
                                           call_utility_all_async=self._all)

    async def _all(self, method, rpc, timeout, args, kwargs):
        assert (method, rpc, args) == ("collective_rpc", "mars_state", (None,))
        return self.ranks

    async def collective_rpc(self, method, args=()):
        return self.ranks[0]  # what AsyncLLM.collective_rpc answers under data parallelism: rank 0 alone


def test_each_data_parallel_rank_has_its_own_series():
    other = {"host_bytes": 0, "scheduler": {**STATE["scheduler"], "running": 5, "retention_hits": 9}}
    _, body = scrape(fake_vllm()[0], FakeDataParallelEngine([[STATE], [other]]))
    values = samples(body.decode())
    one = (("rank", "1"),)
    assert values[("marsched_state_up", R0)] == values[("marsched_state_up", one)] == 1
    assert (values[("marsched_running_requests", R0)], values[("marsched_running_requests", one)]) == (2, 5)
    assert (values[("marsched_retention_hits_total", R0)], values[("marsched_retention_hits_total", one)]) == (5, 9)
    assert values[("marsched_host_kv_bytes", one)] == 0
    assert values[("marsched_retained_conversations", one + (("strategy", "preserve"),))] == 4
    _, body = scrape(fake_vllm()[0], FakeDataParallelEngine(None))  # no answer: both ranks read 0
    values = samples(body.decode())
    assert values[("marsched_state_up", R0)] == values[("marsched_state_up", one)] == 0
