"""A length prediction for every HTTP request, made in the API server: `marsched serve` with the
learned predictor (on by default when the `predict` extra is installed).

An ASGI middleware (`--middleware marsched.serve.prediction.PredictionMiddleware`; the head in
`$MARSCHED_PREDICTOR`, `learned` or `learned:DIR`) reads each `POST /v1/completions`,
`/v1/chat/completions`, `/v1/responses` and `/v1/messages` body before vLLM does:

- the program fields other clients and routers send are read as marsched's own (`program_fields.py`:
  `prompt_cache_key`, `X-Session-ID`, the router's `agentic_context`, Continuum's `job_id`);
- unless the request states `predicted` (or the router's `expected_output_length`), the learned
  model predicts the reply's length from the newest turn's text, the context's size and the
  conversation's previous reply (`turn_text.py`), capped at the request's `max_tokens`
  (completions and chat only);
- every request gets a `rid`, unless it has one, which the client can look up in
  `/marsched/state?request_id=` (the response header `x-marsched-request-id`), and by which the
  API server tells the scheduler about it: its predicted length, the tools its reply called
  (`tool_gaps.py`).

The request does not wait for its number: it goes on to vLLM at once, and the number follows it
to the scheduler on vLLM's abort path, keyed by the `rid` (`marsched.vllm.told_predictions`),
which ranks a request that is still waiting anew; a number that comes first waits for its
request there. The response's `x-marsched-predicted` header carries the number (the response's
first bytes wait for it if they were ready first). A client reusing one `rid` for concurrent requests
may see a number reach the wrong one of them.

Predictions of concurrent requests are batched: while one batch runs in a worker thread (never
on the event loop), the numbers asked meanwhile wait and form the next one. What that costs is
kept (`prediction_stats.py`) and shown in `/marsched/state` and `/metrics`. A conversation's
previous reply length and prompt size come from its earlier responses (`usage`), remembered
per conversation id; characters are turned into tokens at the ratio the responses' `usage`
shows (4 characters a token until one has come).

A request whose body is not JSON, or whose marsched object is malformed, passes through as it
came, for vLLM's validator to answer. A malformed alias is answered here with a 400 naming the
field, and so is a chat request's malformed `tools`, which vLLM would answer with a 500
(`tool_fields.py`). If the model fails, the request goes on unpredicted (the scheduler then reads its plan).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from marsched.serve.asgi_body import COMPLETION_PATHS, GENERATE_PATHS, post_body, replay_body
from marsched.serve.prediction_stats import PredictionStats, publish
from marsched.serve.program_fields import AliasError, alias_fields, client_fields, merged_xargs, own_fields
from marsched.serve.tool_fields import tools_error
from marsched.serve.turn_text import TurnText, chat_turn, completion_turn
from marsched.vllm.told_predictions import send_prediction

ENV = "MARSCHED_PREDICTOR"
PATHS = COMPLETION_PATHS
MAX_BATCH = 64
REMEMBERED = 100_000  # conversations whose last turn is remembered; the oldest is forgotten first
MAX_RESPONSE_BYTES = 16 << 20  # a non-streamed response read for its usage; past this it is not read
DEFAULT_CHARS_PER_TOKEN = 4.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Features:
    text: str
    context_tokens: int
    previous_tokens: int


PredictBatch = Callable[[Sequence[Features]], Sequence[int]]


class PredictionBatcher:
    """Runs `predict` on batches of the requests that wait, one batch at a time, in a worker thread
    of its own: not the event loop's default executor, which vLLM's front end also uses, so that a
    batch never queues behind the server's other work there."""

    def __init__(self, predict: PredictBatch, max_batch: int = MAX_BATCH, stats: PredictionStats | None = None) -> None:
        self._predict = predict
        self._max_batch = max_batch
        self._pending: list[tuple[Features, asyncio.Future[int]]] = []
        self._drainer: asyncio.Task[None] | None = None
        self.stats = stats if stats is not None else PredictionStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="marsched-predict")

    async def predict(self, features: Features) -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((features, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        # It first runs after the tasks already scheduled, so requests read in the same loop turn
        # form the first batch.
        while self._pending:
            batch, self._pending = self._pending[:self._max_batch], self._pending[self._max_batch:]
            try:
                results, seconds = await asyncio.get_running_loop().run_in_executor(
                    self._worker, _timed, self._predict, [features for features, _ in batch])
            except Exception as error:  # noqa: BLE001 - each waiting request gets the failure
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            self.stats.batch(len(batch), seconds)
            for (_, future), result in zip(batch, results):
                if not future.done():  # its client may have left
                    future.set_result(int(result))


def _timed(predict: PredictBatch, batch: list[Features]) -> tuple[Sequence[int], float]:
    started = time.perf_counter()
    results = predict(batch)
    return results, time.perf_counter() - started


@dataclass(slots=True)
class LastTurn:
    context_chars: int
    reply_chars: int | None = None
    reply_tokens: int | None = None


class ConversationMemory:
    """Each conversation's last turn: its prompt's size and, once answered, its reply's."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self._turns: OrderedDict[str, LastTurn] = OrderedDict()
        self._limit = limit

    def get(self, conversation: str | None) -> LastTurn | None:
        return self._turns.get(conversation) if conversation is not None else None

    def put(self, conversation: str, turn: LastTurn) -> None:
        self._turns[conversation] = turn
        self._turns.move_to_end(conversation)
        while len(self._turns) > self._limit:
            self._turns.popitem(last=False)

    def __len__(self) -> int:
        return len(self._turns)


class CharsPerToken:
    """Characters per prompt token, from the responses' `usage` (a running ratio of sums)."""

    def __init__(self) -> None:
        self._chars = 0
        self._tokens = 0

    def observe(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self._chars += chars
            self._tokens += tokens

    @property
    def ratio(self) -> float:
        return self._chars / self._tokens if self._tokens else DEFAULT_CHARS_PER_TOKEN

    def tokens(self, chars: int) -> int:
        return max(round(chars / self.ratio), 0)


class ResponseTally:
    """What a response says of its reply: `usage` and the text's length, streamed (SSE) or not."""

    def __init__(self) -> None:
        self.streamed = False
        self.reply_chars = 0
        self.usage: dict[str, Any] | None = None
        self._buffer = b""
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buffer += chunk
        if self.streamed or self._buffer.startswith(b"data:"):
            self.streamed = True
            *events, self._buffer = self._buffer.split(b"\n\n")
            for event in events:
                self._read_event(event)
        elif len(self._buffer) > MAX_RESPONSE_BYTES:
            self._overflow, self._buffer = True, b""

    def close(self) -> None:
        if self.streamed:
            self._read_event(self._buffer)
        elif not self._overflow:
            try:
                self._read(json.loads(self._buffer))
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
        self._buffer = b""

    def _read_event(self, event: bytes) -> None:
        for line in event.splitlines():
            data = line.removeprefix(b"data:").strip()
            if line.startswith(b"data:") and data and data != b"[DONE]":
                try:
                    self._read(json.loads(data))
                except (ValueError, UnicodeDecodeError, RecursionError):
                    continue

    def _read(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        if isinstance(message.get("usage"), dict):
            self.usage = message["usage"]
        for choice in message.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta") if self.streamed else choice.get("message")
            text = choice.get("text")
            if isinstance(part, dict):
                text = part.get("content")
            if isinstance(text, str):
                self.reply_chars += len(text)


class Predictions:
    """The state the middleware keeps: the model, the batcher, conversations, the token ratio."""

    def __init__(self, predict: PredictBatch, describe: str) -> None:
        self.stats = PredictionStats()
        self.batcher = PredictionBatcher(predict, stats=self.stats)
        self.memory = ConversationMemory()
        self.chars_per_token = CharsPerToken()
        self.describe = describe

    def features(self, body: dict[str, Any], chat: bool, conversation: str | None) -> tuple[Features, int] | None:
        """The request's features and its context's characters, or None if it has no text to read."""
        last = self.memory.get(conversation)
        turn: TurnText | None
        if chat:
            turn = chat_turn(body.get("messages"))
        else:
            turn = completion_turn(body.get("prompt"), last.context_chars if last else None,
                                   last.reply_chars if last else None)
        if turn is None:
            return None
        if last is not None and last.reply_tokens is not None:
            previous = last.reply_tokens
        else:
            previous = self.chars_per_token.tokens(turn.previous_reply_chars or 0)
        return Features(turn.newest, self.chars_per_token.tokens(turn.context_chars), previous), turn.context_chars

    def answered(self, conversation: str | None, context_chars: int, tally: ResponseTally) -> None:
        usage = tally.usage or {}
        prompt_tokens, reply_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt_tokens, int):
            self.chars_per_token.observe(context_chars, prompt_tokens)
        if conversation is not None:
            self.memory.put(conversation, LastTurn(context_chars, tally.reply_chars,
                                                   reply_tokens if isinstance(reply_tokens, int) else None))


def learned_predictions(spec: str) -> Predictions:
    """The learned model named by `spec` (`learned` or `learned:DIR`), loaded now."""
    from marsched.predict.learned import head_directory, load_model

    model = load_model(head_directory(spec))
    model.encoder.load()

    def predict(batch: Sequence[Features]) -> Sequence[int]:
        return [int(n) for n in model.predict([f.text for f in batch], [f.context_tokens for f in batch],
                                              [f.previous_tokens for f in batch])]

    return Predictions(predict, f"learned head {model.directory} ({model.encoder.kind} encoder)")


class PredictionMiddleware:
    def __init__(self, app: Any, predictions: Predictions | None = None) -> None:
        self.app = app
        spec = os.environ.get(ENV)
        self.predictions = predictions if predictions is not None else (learned_predictions(spec) if spec else None)
        if self.predictions is not None:
            publish(self.predictions.stats)
            logger.info("marsched: every request's output length is predicted in the API server by the %s, "
                        "batched up to %d", self.predictions.describe, MAX_BATCH)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await post_body(self.app, scope, receive, send, GENERATE_PATHS)
        if raw is None:
            return
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if isinstance(body, dict) and scope["path"].endswith("chat/completions"):
            wrong = tools_error(body)
            if wrong is not None:
                await _bad_request(send, wrong[1], wrong[0])
                return
        xargs = body.get("vllm_xargs", {}) if isinstance(body, dict) else None
        own = own_fields(xargs) if isinstance(xargs, dict) else None
        if own is None:  # not a body we read: vLLM answers it
            await self.app(scope, replay_body(raw, receive), send)
            return
        try:
            aliases = alias_fields(xargs)
        except AliasError as error:
            await _bad_request(send, str(error), error.field)
            return
        clients = client_fields(body, scope.get("headers", ()))
        conversation = own.get("conversation", aliases.get("conversation", clients.get("conversation")))
        conversation = conversation if isinstance(conversation, str) else None
        extra: dict[str, Any] = {}
        read = None
        started = time.perf_counter()
        if (self.predictions is not None and "predicted" not in own and "predicted" not in aliases
                and scope["path"] in PATHS):
            read = self.predictions.features(body, scope["path"].endswith("chat/completions"), conversation)
        if "rid" not in own:  # a name to tell the scheduler about the request by (its length, its reply's tools)
            extra["rid"] = f"mars-{uuid.uuid4().hex}"
        try:
            new_xargs = merged_xargs(xargs, extra, clients)
        except AliasError as error:  # pragma: no cover - alias_fields raised it already
            await _bad_request(send, str(error), error.field)
            return
        if new_xargs is not None:
            body["vllm_xargs"] = new_xargs
            raw = json.dumps(body).encode()
            scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                         + [(b"content-length", str(len(raw)).encode())])
        told = None
        rid = own.get("rid", extra.get("rid"))
        if read is not None and isinstance(rid, str):
            features, context_chars = read
            cap = body.get("max_completion_tokens", body.get("max_tokens"))
            engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
            # The request goes on now; its number follows it to the scheduler.
            told = Told(asyncio.create_task(self._tell(features, cap, rid, engine, started)), context_chars,
                        time.perf_counter() - started)
        if not extra and told is None:
            await self.app(scope, replay_body(raw, receive), send)
            return
        await self._forward(scope, replay_body(raw, receive), send, extra, conversation, told)

    async def _tell(self, features: Features, cap: Any, rid: str, engine: Any, started: float) -> int | None:
        """Predict the request's length and tell the scheduler (`told_predictions.py`); the number, or
        None if the model failed."""
        assert self.predictions is not None
        stats = self.predictions.stats
        try:
            predicted = await self.predictions.batcher.predict(features)
        except Exception:  # noqa: BLE001 - the request goes on unpredicted
            stats.failed += 1
            logger.exception("marsched: length prediction failed; the request goes on without one")
            return None
        stats.made += 1
        stats.waited(time.perf_counter() - started)
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1:
            predicted = min(predicted, cap)
        predicted = max(predicted, 1)
        if engine is not None:
            try:
                await send_prediction(engine, rid, predicted)
            except Exception:  # noqa: BLE001 - the scheduler ranks the request by its plan
                stats.untold += 1
                logger.exception("marsched: telling the scheduler a length prediction failed")
        return predicted

    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any, extra: dict[str, Any],
                       conversation: str | None, told: Told | None) -> None:
        """Pass the request on, with what was added in the response's headers; a predicted one's
        response is read for the conversation's memory. The number goes in a header, so the
        response's start is held until its first body, which is when a client could see it: the
        response is late only if its first bytes were ready before the number (counted as added)."""
        tally = ResponseTally()
        added = [(b"x-marsched-request-id", extra["rid"].encode())] if "rid" in extra else []
        held: list[dict[str, Any]] = []  # the response's start, waiting for its first body

        async def tallied(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + added)
                if told is not None and self.predictions is not None:
                    held.append(message)
                    return
            elif message["type"] == "http.response.body" and self.predictions is not None and told is not None:
                if held:
                    await send(await self._with_number(held.pop(), told))
                tally.feed(message.get("body", b""))
                if not message.get("more_body"):
                    tally.close()
                    self.predictions.answered(conversation, told.context_chars, tally)
            await send(message)

        await self.app(scope, receive, tallied)

    async def _with_number(self, start: dict[str, Any], told: Told) -> dict[str, Any]:
        """The response's start with the predicted number in its headers, once it is made."""
        assert self.predictions is not None
        held_from = time.perf_counter()
        predicted = await told.task
        self.predictions.stats.added(told.features_s + time.perf_counter() - held_from)
        if predicted is None:
            return start
        return dict(start, headers=list(start["headers"]) + [(b"x-marsched-predicted", str(predicted).encode())])


@dataclass(frozen=True, slots=True)
class Told:
    """A request's prediction on its way to the scheduler."""

    task: asyncio.Task[int | None]
    context_chars: int
    features_s: float  # reading the request's features, on its path


async def _bad_request(send: Any, message: str, field: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": field, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
