"""The API server's length prediction for every request (`marsched.serve.prediction`), its reading
of a request's turns (`turn_text`) and the program fields of other clients (`program_fields`).

The app behind the middleware is a recording ASGI app: what it receives is what vLLM would."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from marsched.serve import prediction_stats
from marsched.serve.prediction import (
    CharsPerToken, Features, PredictionBatcher, PredictionMiddleware, Predictions, ResponseTally,
)
from marsched.serve.prediction_stats import PredictionStats
from marsched.serve.program_fields import AliasError, alias_fields, merged_xargs
from marsched.serve.turn_text import TAIL_CHARS, chat_turn, completion_turn
from marsched.vllm.metadata import parse


@pytest.fixture(autouse=True)
def _unpublished(monkeypatch):
    """A middleware made here publishes its stats process-wide; other tests must not see them."""
    monkeypatch.setattr(prediction_stats, "_published", None)


# --- reading a turn -------------------------------------------------------------------

def test_a_chat_turn_is_what_follows_the_models_last_reply():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "find the bug"},
        {"role": "assistant", "content": "looking",
         "tool_calls": [{"type": "function", "function": {"name": "grep", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "content": "file.py:3: x = 1"},
        {"role": "user", "content": [{"type": "text", "text": "and?"}]},
    ]
    turn = chat_turn(messages)
    assert turn.newest == "file.py:3: x = 1\nand?"
    assert turn.previous_reply_chars == len("looking\ngrep\n{\"q\": \"x\"}")
    assert turn.context_chars == sum(len(t) for t in ("be brief", "find the bug", "looking\ngrep\n{\"q\": \"x\"}",
                                                      "file.py:3: x = 1", "and?"))


def test_a_first_chat_turn_is_its_last_message_with_no_previous_reply():
    turn = chat_turn([{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}])
    assert (turn.newest, turn.previous_reply_chars) == ("hello", None)
    assert chat_turn([]) is None and chat_turn("x") is None


def test_a_completion_turn_is_what_follows_the_previous_prompt_and_reply():
    prompt = "P" * 100 + "R" * 20 + "new text"
    assert completion_turn(prompt, 100, 20).newest == "new text"
    assert completion_turn(prompt, None, None).newest == prompt  # shorter than the tail
    long = "x" * (TAIL_CHARS + 10)
    assert len(completion_turn(long, None, None).newest) == TAIL_CHARS
    assert completion_turn([1, 2, 3], None, None) is None  # token ids: no text


# --- program fields of other clients ----------------------------------------------------

def test_the_routers_agentic_context_becomes_marsched_fields():
    xargs = {"agentic_context": {"program_id": "task-a:lead", "expected_output_length": 300,
                                 "kv_retention_ttl_seconds": 5, "expected_resume": False, "priority": 3}}
    merged = merged_xargs(xargs)
    assert "agentic_context" not in merged  # vLLM's request model refuses an object there
    meta = parse(merged["marsched"])
    assert (meta.conversation, meta.predicted, meta.tool_s, meta.retain) == ("task-a:lead", 300, 5.0, False)


def test_continuums_job_fields_become_marsched_fields_and_our_own_win():
    fields = alias_fields({"job_id": "agent-001", "is_last_step": 1, "last_func_call": "pytest"})
    assert fields == {"conversation": "agent-001", "retain": False}
    merged = merged_xargs({"job_id": "agent-001", "marsched": json.dumps({"conversation": "mine"})})
    assert json.loads(merged["marsched"])["conversation"] == "mine"
    assert merged_xargs({"temperature_hint": 1}) is None  # nothing to change


@pytest.mark.parametrize("xargs, field", [
    ({"agentic_context": {"expected_output_length": 0}}, "vllm_xargs.agentic_context.expected_output_length"),
    ({"agentic_context": {"expected_output_length": True}}, "vllm_xargs.agentic_context.expected_output_length"),
    ({"agentic_context": {"kv_retention_ttl_seconds": -1}}, "vllm_xargs.agentic_context.kv_retention_ttl_seconds"),
    ({"agentic_context": {"program_id": "p" * 300}}, "vllm_xargs.agentic_context.program_id"),
    ({"agentic_context": {"expected_resume": "no"}}, "vllm_xargs.agentic_context.expected_resume"),
    ({"agentic_context": "not json"}, "vllm_xargs.agentic_context"),
    ({"agentic_context": [1]}, "vllm_xargs.agentic_context"),
    ({"job_id": ["a"]}, "vllm_xargs.job_id"),
    ({"is_last_step": 2}, "vllm_xargs.is_last_step"),
])
def test_a_malformed_alias_is_an_error_naming_it(xargs, field):
    with pytest.raises(AliasError) as caught:
        alias_fields(xargs)
    assert caught.value.field == field and str(caught.value).startswith(field)


# --- the middleware ---------------------------------------------------------------------

class RecordingApp:
    """Answers every request with `response` (SSE when streamed) and keeps the bodies it got."""

    def __init__(self, usage=None, text="four", stream=False):
        self.bodies: list[bytes] = []
        self.usage = usage or {"prompt_tokens": 50, "completion_tokens": 7}
        self.text, self.stream = text, stream

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.stream:
            for chunk in (self.text[:2], self.text[2:]):
                event = {"choices": [{"index": 0, "delta": {"content": chunk}}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps({'choices': [], 'usage': self.usage})}\n\ndata: [DONE]\n\n".encode()})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": self.text}}],
                      "usage": self.usage}
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def predictions(seen=None, fail=False, value=40):
    def predict(batch):
        if fail:
            raise RuntimeError("model broke")
        if seen is not None:
            seen.append((list(batch), threading.get_ident()))
        return [value] * len(batch)
    return Predictions(predict, "test model")


class EngineCore:
    """The engine core's client as the API server holds it: keeps the ids of the abort messages."""

    def __init__(self):
        self.aborted: list[str] = []

    async def abort_requests_async(self, request_ids):
        self.aborted.extend(request_ids)


def call(middleware, body, path="/v1/chat/completions", engine_core=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", str(len(raw)).encode())]}
    if engine_core is not None:  # vLLM's app keeps its engine client in app.state.engine_client
        scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=engine_core)))
    asyncio.run(middleware(scope, receive, send))
    return sent


def sent_fields(app, index=-1):
    return json.loads(json.loads(app.bodies[index])["vllm_xargs"]["marsched"])


def chat(content, conversation=None, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    if conversation:
        body["vllm_xargs"] = {"marsched": json.dumps({"conversation": conversation})}
    return body


def test_every_request_gets_a_prediction_capped_at_its_max_tokens_told_after_it_under_its_request_id():
    app, core = RecordingApp(), EngineCore()
    middleware = PredictionMiddleware(app, predictions(value=40))
    sent = call(middleware, chat("hi", max_tokens=16), engine_core=core)
    fields = sent_fields(app)
    assert "predicted" not in fields and fields["rid"].startswith("mars-")  # the request did not wait for it
    assert core.aborted == [f"marsched-predicted:{fields['rid']}\x1f16"]
    headers = dict(sent[0]["headers"])
    assert headers[b"x-marsched-predicted"] == b"16" and headers[b"x-marsched-request-id"] == fields["rid"].encode()
    call(middleware, chat("hi", vllm_xargs={"marsched": json.dumps({"rid": "mine"})}), engine_core=core)
    assert core.aborted[-1] == "marsched-predicted:mine\x1f40" and sent_fields(app)["rid"] == "mine"
    call(middleware, {"model": "m", "prompt": "once upon a time", "max_tokens": 100}, "/v1/completions", core)
    assert core.aborted[-1] == f"marsched-predicted:{sent_fields(app)['rid']}\x1f40"
    summary = middleware.predictions.stats.summary()
    assert summary["made"] == 3 and summary["untold"] == 0


def test_the_request_reaches_vllm_before_its_prediction_is_made():
    reached = threading.Event()
    order: list[str] = []

    class App(RecordingApp):
        async def __call__(self, scope, receive, send):
            order.append("request")
            reached.set()
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            order.append("start")  # a streamed response starts before its first token
            await send({"type": "http.response.body", "body": b"{}"})

    def predict(batch):
        assert reached.wait(10), "the model ran before the request went on"
        time.sleep(0.05)
        order.append("prediction")
        return [5] * len(batch)

    app, core = App(), EngineCore()
    middleware = PredictionMiddleware(app, Predictions(predict, "slow model"))
    sent = call(middleware, chat("hi"), engine_core=core)
    assert order == ["request", "start", "prediction"]  # neither the request nor its response's start waited
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert dict(sent[0]["headers"])[b"x-marsched-predicted"] == b"5"  # its first body waited for the number
    summary = middleware.predictions.stats.summary()
    assert summary["added_max_ms"] >= 40 and summary["wait_max_ms"] >= 50  # this reply was quicker than the model


def test_a_prediction_the_engine_cannot_be_told_is_counted_and_the_request_goes_on():
    class BrokenCore(EngineCore):
        async def abort_requests_async(self, request_ids):
            raise RuntimeError("engine gone")

    app = RecordingApp()
    middleware = PredictionMiddleware(app, predictions(value=7))
    sent = call(middleware, chat("hi"), engine_core=BrokenCore())
    assert sent[0]["status"] == 200 and dict(sent[0]["headers"])[b"x-marsched-predicted"] == b"7"
    assert middleware.predictions.stats.summary()["untold"] == 1


def test_a_stated_prediction_wins_and_the_model_is_not_asked():
    seen: list = []
    app = RecordingApp()
    middleware = PredictionMiddleware(app, predictions(seen))
    core = EngineCore()
    call(middleware, {**chat("hi"), "vllm_xargs": {"marsched": json.dumps({"predicted": 9})}}, engine_core=core)
    call(middleware, {**chat("hi"), "vllm_xargs": {"agentic_context": {"expected_output_length": 11}}},
         engine_core=core)
    assert [sent_fields(app, i)["predicted"] for i in (0, 1)] == [9, 11] and seen == [] and core.aborted == []


def test_bodies_it_does_not_read_pass_unchanged_and_a_bad_alias_is_a_400_naming_it():
    app = RecordingApp()
    middleware = PredictionMiddleware(app, predictions())
    for raw in (b"not json", json.dumps({**chat("x"), "vllm_xargs": {"marsched": "{bad"}}).encode(),
                json.dumps({**chat("x"), "vllm_xargs": {"marsched": {}}}).encode()):  # an object: not over HTTP
        call(middleware, raw)
        assert app.bodies[-1] == raw
    sent = call(middleware, {**chat("x"), "vllm_xargs": {"is_last_step": 5}})
    assert sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["param"] == "vllm_xargs.is_last_step"
    assert len(app.bodies) == 3  # the bad alias never reached vLLM


def test_without_a_model_the_aliases_are_still_read():
    app = RecordingApp()
    call(PredictionMiddleware(app, None), {**chat("x"), "vllm_xargs": {"job_id": 7}})
    fields = sent_fields(app)
    assert fields["conversation"] == "7" and "predicted" not in fields and fields["rid"].startswith("mars-")


def test_a_failing_model_leaves_the_request_unpredicted():
    app = RecordingApp()
    middleware = PredictionMiddleware(app, predictions(fail=True))
    core = EngineCore()
    sent = call(middleware, chat("x", conversation="c"), engine_core=core)
    assert sent[0]["status"] == 200 and "predicted" not in sent_fields(app) and core.aborted == []
    assert b"x-marsched-predicted" not in dict(sent[0]["headers"])
    assert middleware.predictions.stats.failed == 1 and middleware.predictions.stats.made == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_conversations_previous_reply_length_comes_from_its_response(stream):
    seen: list = []
    app = RecordingApp(usage={"prompt_tokens": 10, "completion_tokens": 7}, text="four", stream=stream)
    middleware = PredictionMiddleware(app, predictions(seen))
    call(middleware, chat("x" * 40, conversation="c1"))
    assert seen[0][0][0].previous_tokens == 0
    assert middleware.predictions.chars_per_token.ratio == pytest.approx(4.0)  # 40 chars, 10 tokens
    follow_up = {"model": "m", "vllm_xargs": {"marsched": json.dumps({"conversation": "c1"})}, "messages": [
        {"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "four"},
        {"role": "tool", "content": "result"}]}
    call(middleware, follow_up)
    features = seen[1][0][0]
    assert features.previous_tokens == 7  # the usage's completion tokens, not the text's length
    assert features.text == "result"
    assert features.context_tokens == round(50 / 4.0)


def test_concurrent_requests_are_predicted_in_batches_off_the_event_loop():
    seen: list = []

    def predict(batch):
        seen.append((len(batch), threading.get_ident(), threading.current_thread().name))
        return [len(f.text) for f in batch]

    async def run():
        batcher = PredictionBatcher(predict, max_batch=8)
        loop_thread = threading.get_ident()
        results = await asyncio.gather(*(batcher.predict(Features("x" * n, 1, 0)) for n in range(1, 21)))
        return results, loop_thread

    results, loop_thread = asyncio.run(run())
    assert results == list(range(1, 21))
    assert [n for n, _, _ in seen] == [8, 8, 4]
    assert all(thread != loop_thread for _, thread, _ in seen)
    assert all(name.startswith("marsched-predict") for _, _, name in seen)  # its own worker, not the default


def test_a_response_tally_reads_usage_and_text_split_anywhere():
    tally = ResponseTally()
    stream = (b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\n'
              b'data: {"choices":[{"text":"cde"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
              b'data: [DONE]\n\n')
    for i in range(0, len(stream), 7):
        tally.feed(stream[i:i + 7])
    tally.close()
    assert (tally.streamed, tally.reply_chars, tally.usage) == (True, 5, {"completion_tokens": 3})


def test_chars_per_token_starts_at_four_and_follows_usage():
    ratio = CharsPerToken()
    assert ratio.tokens(400) == 100
    ratio.observe(300, 100)
    ratio.observe(0, 5)  # nothing to learn from
    assert ratio.ratio == 3.0 and ratio.tokens(30) == 10


@pytest.mark.parametrize("tools, field", [
    ("calculator", "tools"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "f"}}, 5], "tools[1]"),
    ([{"type": "function", "function": {"parameters": {}}}], "tools[0].function.name"),
    ([{"type": "function", "function": "f"}], "tools[0].function"),
])
def test_malformed_chat_tools_are_a_400_naming_the_field_before_vllm(tools, field):
    # vLLM 0.32 answers these with a 500 (KeyError) or a 400 naming nothing when tool_choice names a function
    app = RecordingApp()
    middleware = PredictionMiddleware(app, None)
    named = {"type": "function", "function": {"name": "f"}}
    for body in (chat("x", tools=tools, tool_choice=named), chat("x", tools=tools)):
        sent = call(middleware, body)
        error = json.loads(sent[1]["body"])["error"]
        assert sent[0]["status"] == 400 and error["param"] == field and error["message"].startswith(field), error
    assert app.bodies == []
    good = [{"type": "function", "function": {"name": "f"}}, {"function": {"name": "g", "parameters": {}}}]
    call(middleware, chat("x", tools=good, tool_choice=named))
    call(middleware, {"model": "m", "prompt": "p", "tools": "calculator"}, "/v1/completions")  # vLLM's to judge
    assert len(app.bodies) == 2


def test_each_predicted_request_records_its_wait_and_the_middleware_publishes_its_stats():
    app = RecordingApp()
    middleware = PredictionMiddleware(app, predictions(value=40))
    assert prediction_stats.published() is middleware.predictions.stats
    for _ in range(3):
        call(middleware, chat("hi"))
    call(middleware, {**chat("hi"), "vllm_xargs": {"marsched": json.dumps({"predicted": 9})}})  # not asked
    summary = middleware.predictions.stats.summary()
    assert summary["made"] == 3 and summary["window"] == 3 and summary["batches"] == 3
    assert summary["batch_max"] == 1 and 0 < summary["wait_p50_ms"] <= summary["wait_p99_ms"] <= summary["wait_max_ms"]
    assert 0 < summary["added_p50_ms"] <= summary["added_p99_ms"] <= summary["added_max_ms"]


def test_the_wait_a_request_records_includes_the_batch_ahead_of_it():
    def predict(batch):
        import time
        time.sleep(0.05)
        return [1] * len(batch)

    async def run():
        stats = PredictionStats()
        batcher = PredictionBatcher(predict, max_batch=2, stats=stats)

        async def one():
            started = asyncio.get_running_loop().time()
            await batcher.predict(Features("x", 1, 0))
            stats.waited(asyncio.get_running_loop().time() - started)

        await asyncio.gather(*(one() for _ in range(4)))
        return stats.summary()

    summary = asyncio.run(run())
    assert summary["batches"] == 2 and summary["batch_mean"] == 2 and summary["batch_max"] == 2
    assert summary["wait_max_ms"] >= 100  # the second batch waited for the first
    assert 50 <= summary["batch_p50_ms"] <= summary["batch_p99_ms"] < 100  # each batch's own time


def test_prediction_stats_keep_the_most_recent_waits():
    stats = PredictionStats(window=100)
    for ms in [1000.0] * 100 + [float(n) for n in range(1, 101)]:
        stats.waited(ms / 1e3)
    summary = stats.summary()
    assert summary["window"] == 100 and summary["wait_max_ms"] == 100
    assert summary["wait_p50_ms"] == 50.5 and summary["wait_p99_ms"] == 99.01
    assert "batch_mean" not in PredictionStats().summary() and "wait_p99_ms" not in PredictionStats().summary()


def test_prediction_stats_keep_the_most_recent_batches_and_round_to_microseconds():
    stats = PredictionStats(window=100)
    for _ in range(100):
        stats.batch(64, 1.0)
    for n in range(1, 101):
        stats.batch(n, n / 1e3)
    stats.waited(0.00012345)
    summary = stats.summary()
    assert summary["batches"] == 200 and summary["batch_max"] == 100 and summary["batch_mean"] == 50.5
    assert summary["batch_p50_ms"] == 50.5 and summary["batch_p99_ms"] == 99.01
    assert summary["wait_p50_ms"] == summary["wait_p99_ms"] == summary["wait_max_ms"] == 0.123
    few = PredictionStats()
    for size in (1, 1, 2):
        few.batch(size, 0.00123456)
    few.failed = 2
    summary = few.summary()
    assert summary["batch_mean"] == 1.33 and summary["batch_p50_ms"] == summary["batch_p99_ms"] == 1.235
    assert summary["failed"] == 2 and summary["made"] == 0 and summary["window"] == 0
