"""The augmented-request runtime: `AugmentedEngine` over vLLM's `AsyncLLM`.

A request generates until a tool call, the tool runs asynchronously, its result is
appended to the same request's context and generation continues, as many times as
the request calls tools. It is one vLLM resumable (streaming-input) request: each
segment after the first is one more input chunk.

**The tool-call token contract.** A segment ends with a tool call either by a stop
token id (live tools: `tool_tokens={token_id: tool_name}`) or by `max_tokens`
(trace replay: `steps=[Step(max_tokens, ToolCall(...)), ...]`). vLLM keeps a
paused request's context only up to its computed tokens, so the segment's last
sampled token (the tool-call token, or the last token of a replayed segment) is
not in it. The runtime therefore sends `[segment[-1]] + tool_result_tokens` as the
next chunk. The context the model sees is then exactly
`prompt + segment_0 + result_0 + segment_1 + ...`, the sequence of one
uninterrupted request, and greedy output is token-identical to it (tested under
Preserve, Discard and Swap).

**Faults.** A tool that raises, times out (its `timeout_s`) or returns garbage (not
a `str` or a list of token ids inside the vocabulary) ends only its request: vLLM
aborts it, which frees its device blocks and its host copy, and the result carries
`error`. `AugmentedEngine.abort(request_id)` (or cancelling the task that awaits
`generate`) does the same from the client's side.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.protocol import StreamingInput
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from marsched.policy import Strategy
from marsched.vllm.config import MarsConfig
from marsched.vllm.metadata import MAX_RID_CHARS, ChunkMeta, PlannedSegment
from marsched.vllm.tools import ToolError, ToolRegistry, default_tools
from marsched.workload.model import ApiType

SCHEDULER_CLS = "marsched.vllm.scheduler.MarsScheduler"
WORKER_EXTENSION_CLS = "marsched.vllm.inspect.MarsWorkerExtension"


def swap_connector_config() -> KVTransferConfig:
    return KVTransferConfig(kv_connector="HostSwapConnector", kv_role="kv_both",
                            kv_connector_module_path="marsched.vllm.kv_swap")


@dataclass(frozen=True, slots=True)
class ToolCall:
    tool: str
    args: Any = None
    expected_duration_s: float | None = None  # default: the tool's
    expected_return_tokens: int | None = None
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One planned segment: generate `max_tokens` tokens, then make `call` (None: the end)."""

    max_tokens: int
    call: ToolCall | None = None
    expected_output_tokens: int | None = None  # what the predictor is told; default max_tokens


@dataclass(slots=True)
class SegmentResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    tool: str | None = None
    tool_args: Any = None
    returned_token_ids: list[int] = field(default_factory=list)
    tool_duration_s: float | None = None
    # from the scheduler (MarsScheduler): predictions at the segment's start, the strategy
    predicted_output_tokens: int | None = None
    predicted_api_s: float | None = None
    predicted_return_tokens: int | None = None
    strategy: str | None = None
    strategy_assigned_s: float | None = None  # time.monotonic() of the assignment
    strategy_reason: str | None = None


@dataclass(slots=True)
class AugmentedResult:
    request_id: str
    prompt_token_ids: list[int]
    segments: list[SegmentResult] = field(default_factory=list)
    error: str | None = None
    aborted: bool = False
    arrival_t: float = 0.0
    first_token_t: float | None = None  # time.monotonic() when the first output token reached the client
    finish_t: float = 0.0
    preemptions: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def token_ids(self) -> list[int]:
        """The whole context: prompt, then each segment and its tool's returned tokens."""
        tokens = list(self.prompt_token_ids)
        for s in self.segments:
            tokens += s.token_ids + s.returned_token_ids
        return tokens


class AugmentedEngine:
    """`AsyncLLM` with `MarsScheduler`, the Swap connector and the tool loop.

    >>> engine = AugmentedEngine(model="path/or/name", policy="mars")
    >>> await engine.start()
    >>> result = await engine.generate(prompt_ids, steps=[Step(24, ToolCall("calculator", "2+3")), Step(16)])
    """

    def __init__(
        self,
        model: str,
        policy: str = "mars",
        *,
        tools: ToolRegistry | None = None,
        trace_path: str | None = None,
        swap: bool = True,
        mars: MarsConfig | dict[str, Any] | None = None,
        stat_loggers: list[Any] | None = None,
        scheduler_cls: str = SCHEDULER_CLS,  # dotted name of a MarsScheduler subclass (bench: step timing)
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(mars, dict):
            mars = MarsConfig.from_dict({"policy": policy, **mars})
        mars = mars or MarsConfig(policy=policy)
        if trace_path is not None:
            mars = MarsConfig.from_dict({**mars.to_dict(), "trace_path": str(trace_path)})
        self.config = mars
        self.tools = tools or default_tools()
        engine_kwargs.setdefault("enable_prefix_caching", False)  # see docs/vllm-plugin.md
        # One worker in the engine-core process, so that `state()` can read the scheduler.
        if engine_kwargs.get("tensor_parallel_size", 1) == 1 and engine_kwargs.get("pipeline_parallel_size", 1) == 1:
            engine_kwargs.setdefault("distributed_executor_backend", "uni")
        self._args = AsyncEngineArgs(
            model=model,
            scheduler_cls=scheduler_cls,
            worker_extension_cls=WORKER_EXTENSION_CLS,
            additional_config=mars.additional_config(),
            kv_transfer_config=swap_connector_config() if swap else None,
            **engine_kwargs,
        )
        self._stat_loggers = stat_loggers
        self.llm: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        # The learned length predictor runs here, in the front end, off the engine core's critical
        # path; the scheduler reads its predictions from each chunk's metadata.
        self._learned: Any = None
        if mars.learned:
            from marsched.predict.learned import head_directory, load_model

            self._learned = load_model(head_directory(mars.predictor))

    async def start(self) -> "AugmentedEngine":
        if self._learned is not None:
            await asyncio.to_thread(self._learned.encoder.load)  # the weights, before the first request
        if self.llm is None:
            self.llm = AsyncLLM.from_engine_args(self._args, stat_loggers=self._stat_loggers)
            self._vocab_size = self.llm.model_config.get_vocab_size()
            self._tokenizer = self.llm.tokenizer
        return self

    async def __aenter__(self) -> "AugmentedEngine":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine. Its core process gets `timeout_s` to exit before it is killed (vLLM's
        own default is 5 s, which a busy 2-core machine can exceed; the scheduler writes the
        trace's `end` event on the way out)."""
        if self.llm is not None:
            self.llm.shutdown(timeout=timeout_s)
            self.llm = None

    async def state(self, request_id: str | None = None) -> dict[str, Any]:
        """Engine state between steps: device blocks, host copies, and one request's decisions."""
        assert self.llm is not None, "call start() first"
        results = await self.llm.collective_rpc("mars_state", args=(request_id,))
        return results[0]

    async def abort(self, request_id: str) -> bool:
        """End a request from the client's side; its `generate` returns with `aborted=True`."""
        task = self._tasks.get(request_id)
        if task is None or task.done():
            return False
        self._aborted.add(request_id)
        task.cancel()
        return True

    # --- generation -----------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        steps: list[Step] | None = None,
        *,
        max_tokens: int = 256,
        tool_tokens: dict[int, str] | None = None,
        parse_args: Callable[[list[int], str], Any] | None = None,
        max_calls: int = 16,
        request_id: str | None = None,
        strategy: Strategy | str | None = None,
        predicted_tokens: list[int | None] | None = None,
        **sampling: Any,
    ) -> AugmentedResult:
        """Run one augmented request to its end.

        Trace replay: `steps` fixes each segment's length and call. Live tools:
        `tool_tokens` maps stop token ids to tool names; the tool's argument is
        `parse_args(segment_tokens, segment_text)` (default: the segment's text).
        `strategy` overrides the policy for this request's calls (tests, benches).
        `predicted_tokens` gives each segment's predicted output length (a trace replay's
        predictions, `marsched bench`); without it, under the learned predictor, each segment's
        length is predicted here from its text (the prompt, then each tool's result), the
        context's length and the previous segment's length.
        Other keywords go to `SamplingParams` (default: greedy).
        """
        assert self.llm is not None, "call start() first"
        rid = request_id or f"aug-{uuid.uuid4().hex[:12]}"
        if len(rid) > MAX_RID_CHARS:  # it rides in the metadata the scheduler checks
            raise ValueError(f"request_id: at most {MAX_RID_CHARS} characters, got {len(rid)}")
        result = AugmentedResult(rid, list(prompt_token_ids), arrival_t=time.monotonic())
        self._tasks[rid] = asyncio.current_task()
        try:
            await self._run(result, steps, max_tokens, tool_tokens or {}, parse_args, max_calls,
                            Strategy(strategy) if strategy else None, sampling, predicted_tokens)
        except asyncio.CancelledError:
            if rid not in self._aborted:
                raise
            result.error, result.aborted = "aborted by the client", True
        except ToolError as error:
            result.error = str(error)
        finally:
            self._tasks.pop(rid, None)
            self._aborted.discard(rid)
            while result.segments and not result.segments[-1].token_ids and result.segments[-1].tool is None:
                result.segments.pop()  # opened for a segment that never ran (end of session, fault)
        result.finish_t = time.monotonic()
        try:
            await self._attach_decisions(result)
        except Exception:  # noqa: BLE001 - decisions are informative; the tokens are the result
            pass
        return result

    def _plan(self, steps: list[Step] | None, max_tokens: int) -> tuple[PlannedSegment, ...]:
        if not steps:
            return (PlannedSegment(max_tokens),)
        plan = []
        for index, step in enumerate(steps):
            if step.call is None or index == len(steps) - 1:
                plan.append(PlannedSegment(step.expected_output_tokens or step.max_tokens))
                continue
            tool = self.tools.get(step.call.tool)
            plan.append(PlannedSegment(
                step.expected_output_tokens or step.max_tokens,
                tool.api_type,
                step.call.expected_duration_s if step.call.expected_duration_s is not None else tool.expected_duration_s,
                step.call.expected_return_tokens if step.call.expected_return_tokens is not None
                else tool.expected_return_tokens,
            ))
        return tuple(plan)

    def _params(self, index: int, plan: tuple[PlannedSegment, ...], rid: str, max_tokens: int,
                 stop_token_ids: list[int], strategy: Strategy | None, sampling: dict[str, Any],
                 predicted: int | None = None) -> SamplingParams:
        kwargs = {"temperature": 0.0, **sampling}
        meta = ChunkMeta(index, plan, strategy, rid, predicted)
        return SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids or None,
                              output_kind=RequestOutputKind.DELTA, extra_args=meta.to_extra_args(), **kwargs)

    async def _predict(self, index: int, token_ids: list[int], context_tokens: int, previous_tokens: int,
                       given: list[int | None] | None) -> int | None:
        """The segment's predicted output tokens for the chunk's metadata, or None (no prediction)."""
        if given is not None:
            value = given[index] if index < len(given) else None
            return max(int(value), 1) if value is not None else None
        if self._learned is None or self._tokenizer is None:
            return None
        text = self._tokenizer.decode(token_ids)
        # In a thread: the event loop keeps streaming other requests' tokens meanwhile.
        return await asyncio.to_thread(self._learned.predict_one, text, context_tokens, previous_tokens)

    async def _run(self, result: AugmentedResult, steps: list[Step] | None, max_tokens: int,
                   tool_tokens: dict[int, str], parse_args: Any, max_calls: int,
                   strategy: Strategy | None, sampling: dict[str, Any],
                   predicted_tokens: list[int | None] | None = None) -> None:
        plan = self._plan(steps, max_tokens)
        stop_ids = sorted(tool_tokens)
        ended: asyncio.Queue[SegmentResult] = asyncio.Queue()

        def seg_max_tokens(index: int) -> int:
            return steps[index].max_tokens if steps else max_tokens

        def next_call(segment: SegmentResult) -> tuple[str, Any] | None:
            if steps is not None:
                if segment.index >= len(steps) - 1:
                    return None
                call = steps[segment.index].call
                return (call.tool, call.args) if call is not None else None
            if segment.index >= max_calls or not segment.token_ids or segment.token_ids[-1] not in tool_tokens:
                return None
            tool = tool_tokens[segment.token_ids[-1]]
            text = self._tokenizer.decode(segment.token_ids[:-1]) if self._tokenizer else ""
            return tool, (parse_args(segment.token_ids, text) if parse_args else text)

        async def inputs():
            nonlocal plan
            index = 0
            chunk = list(result.prompt_token_ids)
            context = len(chunk)
            previous = 0  # the tokens the previous segment generated
            while True:
                if index == 0:
                    params = first
                else:  # the segment after a call: predicted from the tool's result
                    predicted = await self._predict(index, chunk[1:], context, previous, predicted_tokens)
                    params = self._params(index, plan, result.request_id, seg_max_tokens(index), stop_ids, strategy,
                                          sampling, predicted)
                yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(chunk)), sampling_params=params)
                segment = await ended.get()
                call = next_call(segment)
                if call is None:
                    return
                segment.tool, segment.tool_args = call
                started = time.monotonic()
                timeout = steps[segment.index].call.timeout_s if steps else None
                output = await self.tools.call(call[0], call[1], timeout)
                segment.tool_duration_s = time.monotonic() - started
                segment.returned_token_ids = self._to_tokens(call[0], output)
                if len(plan) <= index + 1:  # live: more calls than expected
                    tool = self.tools.get(call[0])
                    last = plan[-1]
                    plan = plan[:-1] + (PlannedSegment(last.output_tokens, tool.api_type, tool.expected_duration_s,
                                                       tool.expected_return_tokens), PlannedSegment(max_tokens))
                chunk = [segment.token_ids[-1]] + segment.returned_token_ids
                context += len(segment.token_ids) + len(segment.returned_token_ids)
                previous = len(segment.token_ids)
                index += 1

        predicted = await self._predict(0, result.prompt_token_ids, len(result.prompt_token_ids), 0, predicted_tokens)
        first = self._params(0, plan, result.request_id, seg_max_tokens(0), stop_ids, strategy, sampling, predicted)
        current = SegmentResult(0)
        result.segments.append(current)
        async for out in self.llm.generate(inputs(), first, request_id=result.request_id):
            completion = out.outputs[0]
            if completion.token_ids and result.first_token_t is None:
                result.first_token_t = time.monotonic()
            current.token_ids.extend(completion.token_ids)
            if completion.finish_reason is not None and current.finish_reason is None:
                current.finish_reason = completion.finish_reason
                ended.put_nowait(current)
                if not out.finished:
                    current = SegmentResult(current.index + 1)
                    result.segments.append(current)

    def _to_tokens(self, tool: str, output: Any) -> list[int]:
        if isinstance(output, str):
            if self._tokenizer is None:
                raise ToolError(f"tool {tool!r} returned text, but the engine has no tokenizer")
            return list(self._tokenizer.encode(output, add_special_tokens=False))
        if isinstance(output, (list, tuple)) and all(type(t) is int for t in output):
            bad = [t for t in output if not 0 <= t < self._vocab_size]
            if bad:
                raise ToolError(f"tool {tool!r} returned token ids outside the vocabulary "
                                f"[0, {self._vocab_size}): {bad[:5]}")
            return list(output)
        raise ToolError(f"tool {tool!r} returned garbage: expected str or list of token ids, "
                        f"got {type(output).__name__} {str(output)[:60]!r}")

    async def _attach_decisions(self, result: AugmentedResult) -> None:
        state = await self.state(result.request_id)
        info = (state.get("scheduler") or {}).get("request")
        if not info:
            return
        result.preemptions = info.get("preemptions")
        for seg, decided in zip(result.segments, info["segments"]):
            seg.predicted_output_tokens = decided["predicted_output_tokens"]
            seg.predicted_api_s = decided["predicted_api_s"]
            seg.predicted_return_tokens = decided["predicted_return_tokens"]
            seg.strategy = decided["strategy"]
            seg.strategy_assigned_s = decided["assigned_s"]
            seg.strategy_reason = decided["reason"]


__all__ = ["AugmentedEngine", "AugmentedResult", "SegmentResult", "Step", "ToolCall", "ApiType"]
