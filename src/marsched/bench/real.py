"""`marsched bench`: replay a trace on real vLLM, one engine per (policy, load), and measure it.

Each point (policy, qps) starts an `AugmentedEngine` (vLLM's `AsyncLLM` with `MarsScheduler`
and `HostSwapConnector`, the scheduler timing each step: `marsched.bench.steps`), replays a
Poisson stream of the trace's requests against the wall clock, drains it, shuts the engine
down, and turns what it measured into the same metrics record as `compare` (built from
`RequestRecord`s by `metrics.records.summarize`) with `engine: "vllm"`.

How a trace request becomes a real request:

- **Arrivals, token scaling, token ids**: `marsched.bench.stream` (the simulator's Poisson
  stream, every token count × `token_scale` and shrunk to fit the engine's `max_model_len`,
  prompt ids seeded by the request id). `max_model_len` is the smallest of the model's
  `max_position_embeddings`, the KV cache (one request must fit alone) and `--max-model-len`
  (`marsched.bench.engine_config`).
- **Segments**: each segment's length is forced (`max_tokens` per chunk, `ignore_eos`), and the
  plan the scheduler predicts from (marsched metadata) carries the true lengths (the oracle
  predictor sees the truth; `--predictor noisy:SIGMA` blurs it).
- **API calls**: a call is a timed sleep of `api_time_scale` × its duration, by a tool of the
  call's API type (`sleep-math`, `sleep-qa`, ...), so that per-type duration estimates work as
  in the simulator. A trailing call (the request ends with it) is slept by the client after the
  last segment: the engine has already freed the request's KV cache, as the simulator does.

Latencies are measured by the client: a request *arrives* at its planned time (so client lag
counts against latency; its mean is reported as `client_lag_mean_s`), its first token is when
the first output token reaches the client, and it finishes when its last segment (or trailing
call) ends. Preemptions, queue waits and the strategy of each call come from the scheduler's
event trace. The iteration statistics are the engine's steps during the run (`steps.py`).
`isolated_e2e_s` has no measurement here: it is estimated with the simulator's
`isolated_latency` under `c + a·tokens` fitted to the run's own steps (`iteration.fit`);
`marsched.bench.records` builds the record.

This module imports vLLM only inside `run_bench`; the rest runs without it.
"""

from __future__ import annotations

import asyncio
import gc
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marsched.bench.engine_config import EnginePlan, engine_kwargs, restore_environment, set_engine_environment
from marsched.bench.model import ModelInfo, read_model
from marsched.bench.options import engine_profile
from marsched.bench.records import (
    Outcome, bench_record, iteration_cost, iteration_stats, read_jsonl, request_records,
)
from marsched.bench.spec import BenchSpec
from marsched.bench.stream import bench_requests, prompt_token_ids, return_token_ids
from marsched.workload.loader import load_trace
from marsched.workload.model import ApiType, Request, build_request

ProgressFn = Callable[[str, int, int], None]  # (what is running, done, total)


@dataclass(slots=True)
class BenchResult:
    records: list[dict[str, Any]]
    partial: bool = False  # interrupted (Ctrl-C) or ended by an engine that died
    error: str | None = None  # why the run ended early, if not a Ctrl-C


def run_bench(spec: BenchSpec, on_record: Callable[[dict], None] | None = None,
              on_progress: ProgressFn | None = None) -> BenchResult:
    """Run every (policy, qps) point in turn; Ctrl-C ends the run with what was measured, `partial`."""
    spec.check()
    model = read_model(spec.model)
    plan = spec.engine_plan(model)
    templates = load_trace(spec.trace, strict=spec.strict)
    streams = {qps: bench_requests(templates, qps, spec.duration_s, spec.seed, spec.token_scale,
                                   plan.max_model_len, spec.api_time_scale, spec.max_requests) for qps in spec.qps}
    predictions = trace_predictions(spec, templates, [r for stream in streams.values() for r in stream])
    result = BenchResult([])

    async def main() -> None:
        for qps in spec.qps:
            for policy in spec.policies:
                record, interrupted = await _run_point(spec, model, plan, policy, qps, streams[qps], on_progress,
                                                       predictions)
                if record is not None:
                    result.records.append(record)
                    if on_record:
                        on_record(record)
                if interrupted or _cancelling():
                    result.partial = True
                    result.error = record.get("error") if record else None
                    return

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # a second Ctrl-C, or a first one that came while no await was pending
        result.partial = True
    finally:
        for engine in list(_LIVE):  # only after a second Ctrl-C cut a shutdown short
            _shutdown(engine)
        gc.collect()  # vLLM's AsyncLLM objects in reference cycles: finalize them now, not at exit
    return result


_LIVE: list[Any] = []  # engines started and not yet shut down


def trace_predictions(spec: BenchSpec, templates: list[Request], requests: list[Request]) -> dict[str, list[int]]:
    """Per request, each segment's predicted output tokens, for predictors that work from the trace.

    `type-mean` and `learned` predict from the trace (its type means, its text records'
    text; `marsched.predict.learned`): the bench's prompts are random token ids with no text, so
    the client computes these from the trace, scales them by `--token-scale` like the lengths,
    and sends them with each segment as the front end's prediction. Other predictors: none.
    """
    from marsched.predict.length import parse_length_predictor, prepare_length_predictor

    if spec.predictor != "type-mean" and not spec.predictor.startswith("learned"):
        return {}
    length = parse_length_predictor(spec.predictor, spec.seed)
    prepare_length_predictor(length, templates, spec.trace)
    return {r.request_id: [max(1, round(length.predict(r, i) * spec.token_scale)) for i in range(len(r.segments))]
            for r in requests}


def _shutdown(engine: Any) -> None:
    try:
        engine.shutdown()
    finally:
        if engine in _LIVE:
            _LIVE.remove(engine)


def _cancelling() -> bool:
    """Whether this task was asked to stop (Ctrl-C: asyncio.run cancels its main task)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _settle(tasks: list[asyncio.Future]) -> None:
    """Cancel the request tasks and let them finish (each aborts its vLLM request)."""
    for task in tasks:
        task.cancel()
    for _ in range(3):  # a Ctrl-C not yet delivered to this task cancels the first wait
        try:
            await asyncio.wait(tasks, timeout=10.0)
            return
        except asyncio.CancelledError:
            continue


def _tools(vocab_size: int):
    from marsched.vllm.tools import default_tools, sleep

    registry = default_tools()
    for api_type in ApiType:
        registry.register(f"sleep-{api_type.value}", sleep, api_type, expected_duration_s=1.0,
                          expected_return_tokens=20, timeout_s=1e6)
    return registry


def _steps_of(request: Request, vocab_size: int) -> list[Any]:
    from marsched.vllm import Step, ToolCall

    steps = []
    last = len(request.segments) - 1
    for index, segment in enumerate(request.segments):
        api = segment.api
        if api is None or index == last:  # a trailing call is slept by the client
            steps.append(Step(segment.output_tokens))
            continue
        tokens = return_token_ids(request.request_id, index, api.return_tokens, vocab_size)
        steps.append(Step(segment.output_tokens, ToolCall(
            f"sleep-{api.api_type.value}", {"duration_s": api.duration_s, "tokens": tokens},
            expected_duration_s=api.duration_s, expected_return_tokens=api.return_tokens)))
    return steps


async def _one(engine: Any, outcome: Outcome, vocab_size: int, predicted: list[int] | None = None) -> None:
    request = outcome.request
    delay = outcome.planned_t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    outcome.submitted_t = time.monotonic()
    prompt = prompt_token_ids(request.request_id, request.prompt_tokens, vocab_size)
    try:
        result = await engine.generate(prompt, _steps_of(request, vocab_size), request_id=request.request_id,
                                       predicted_tokens=predicted, ignore_eos=True, detokenize=False)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - an engine that died ends every request; report, not crash
        outcome.error = f"{type(error).__name__}: {error}"
        return
    if result.error:
        outcome.error = result.error
        return
    outcome.first_token_t = result.first_token_t if result.first_token_t is not None else math.nan
    outcome.output_tokens = len(result.output_token_ids)
    outcome.api_time_s = sum(s.tool_duration_s or 0.0 for s in result.segments)
    outcome.api_return_tokens = sum(len(s.returned_token_ids) for s in result.segments)
    outcome.strategies = [s.strategy for s in result.segments if s.tool is not None and s.strategy]
    trailing = request.segments[-1].api
    if trailing is not None:  # the request ends when its last call returns
        started = time.monotonic()
        await asyncio.sleep(trailing.duration_s)
        outcome.api_time_s += time.monotonic() - started
        outcome.api_return_tokens += trailing.return_tokens
    outcome.finish_t = time.monotonic()


async def _run_point(spec: BenchSpec, model: ModelInfo, plan: EnginePlan, policy: str, qps: float,
                     requests: list[Request], on_progress: ProgressFn | None,
                     predictions: dict[str, list[int]] | None = None) -> tuple[dict | None, bool]:
    """One engine, one stream. Returns (record or None if nothing ran, interrupted)."""
    from marsched.bench.steps import ENV_VAR, STEP_TIMED_MARS
    from marsched.vllm import AugmentedEngine

    label = f"{policy} @ {qps:g} qps"
    workdir = Path(tempfile.mkdtemp(prefix="marsched-bench-"))
    step_log, trace_path = workdir / "steps.jsonl", workdir / "events.jsonl"
    saved_env = set_engine_environment(plan, {ENV_VAR: str(step_log)})
    mars = {"predictor": spec.predictor, "api_estimator": spec.api_estimator, "seed": spec.seed,
            "starvation": spec.starvation}
    if spec.profile is not None:
        mars["profile"] = engine_profile(spec.profile)
    engine = AugmentedEngine(spec.model, policy=policy, tools=_tools(model.vocab), trace_path=str(trace_path),
                             mars=mars, scheduler_cls=STEP_TIMED_MARS, **engine_kwargs(plan, spec.seed))
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Future] = []
    interrupted = False
    started_run = time.monotonic()
    t0 = math.nan
    capacity: dict[str, Any] = {}
    timings: dict[str, float] = {}
    try:
        if on_progress:
            on_progress(f"{label}: starting vLLM", 0, len(requests))
        try:
            if _cancelling():
                raise asyncio.CancelledError
            _LIVE.append(engine)
            begin = time.monotonic()
            await engine.start()  # blocks; a Ctrl-C here kills the engine's processes, then start() raises
            timings["engine_start_s"] = time.monotonic() - begin
            vllm_config = engine.llm.vllm_config
            vocab = engine.llm.model_config.get_vocab_size()
            blocks = int(vllm_config.cache_config.num_gpu_blocks or 0) - 1  # vLLM's null block is never free
            block_size = int(vllm_config.cache_config.block_size)
            capacity = {"blocks": blocks, "block_tokens": block_size, "tokens": blocks * block_size,
                        "bytes_per_token": plan.engine_model(model).kv_bytes_per_token,
                        "gb": spec.kv_cache_gb,
                        "max_model_len": int(vllm_config.model_config.max_model_len),
                        "max_num_seqs": int(vllm_config.scheduler_config.max_num_seqs),
                        "max_num_batched_tokens": int(vllm_config.scheduler_config.max_num_batched_tokens)}
            # Warm-up: the first forward passes of new shapes are slow; not measured.
            await engine.generate(prompt_token_ids("warmup", min(256, plan.max_model_len // 2), vocab),
                                  _steps_of(build_request("warmup", 1, [(8, None)]), vocab), ignore_eos=True,
                                  detokenize=False)
            t0 = time.monotonic() + 0.05
            timings["warmup_s"] = t0 - begin - timings["engine_start_s"]
            outcomes = [Outcome(r, t0 + r.arrival_s) for r in requests]
            tasks = [asyncio.ensure_future(_one(engine, o, vocab, (predictions or {}).get(o.request.request_id)))
                     for o in outcomes]
            done = 0
            if on_progress:
                on_progress(label, 0, len(tasks))
            for next_done in asyncio.as_completed(tasks):
                await next_done
                done += 1
                if on_progress:
                    on_progress(label, done, len(tasks))
        except asyncio.CancelledError:
            interrupted = True
        except Exception:
            if not _cancelling():  # vLLM failed on its own
                raise
            interrupted = True  # the engine died of the Ctrl-C (it reaches the whole process group)
        # A Ctrl-C that killed the engine ends every request with an error before it reaches this task.
        interrupted = interrupted or _cancelling()
        died = not interrupted and engine.llm is not None and engine.llm.errored
        if tasks and (interrupted or died):
            await _settle(tasks)
    finally:
        begin = time.monotonic()
        _shutdown(engine)
        timings["engine_shutdown_s"] = time.monotonic() - begin
        restore_environment(saved_env)
    wallclock = time.monotonic() - started_run
    try:
        if math.isnan(t0):
            return None, interrupted
        steps = [s for s in read_jsonl(step_log) if s["t"] >= t0]
        events = read_jsonl(trace_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    iteration = iteration_stats(steps)
    cost = iteration_cost(iteration["fit"], capacity["max_num_batched_tokens"])
    records = request_records(outcomes, events, t0, cost)
    record = bench_record(spec, model, plan, policy, qps, requests, outcomes, records, iteration, capacity,
                          wallclock, interrupted or died)
    record.update(timings)
    if died:
        record["error"] = f"vLLM's engine died during {label}; see its log above"
    return record, interrupted or died
