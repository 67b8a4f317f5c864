"""`marsched bench`: replay a trace on real vLLM, one engine per (policy, load), and measure it.

Each point (policy, qps) starts an `AugmentedEngine` (vLLM's `AsyncLLM` with `MarsScheduler`
and `HostSwapConnector`, the scheduler timing each step: `marsched.bench.steps`), replays a
Poisson stream of the trace's requests against the wall clock, drains it, shuts the engine
down, and turns what it measured into the same metrics record as `compare` (built from
`RequestRecord`s by `metrics.records.summarize`) with `engine: "vllm"`.

How a trace request becomes a real request:

- **Arrivals**: `poisson_arrivals(templates, qps, duration, seed)` (the simulator's stream);
  `max_requests` keeps its first N.
- **Tokens**: the prompt's token ids are drawn from a generator seeded by the request id
  (`prompt_token_ids`), as are each call's returned ids; ids avoid the special tokens 0-3.
- **Token scaling** (`scale_request`): every token count (prompt, each segment's output, each
  call's return) is multiplied by `token_scale` and rounded (outputs and the prompt at least
  1); a request whose final context still exceeds the engine's `max_model_len` is scaled
  again, as a whole, until it fits. `max_model_len` is the smallest of the model's
  `max_position_embeddings`, the KV cache (one request must fit alone) and `--max-model-len`.
  So the shape of each request is kept, only smaller.
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
`isolated_latency` under `c + a·tokens` fitted to the run's own steps (`iteration.fit`).

This module imports vLLM only inside `run_bench`; the rest runs without it.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from marsched.metrics.records import RequestRecord, summarize
from marsched.policy.cost_model import CostModel
from marsched.policy.registry import POLICY_NAMES, SIMULATOR_ONLY
from marsched.sim.isolated import isolated_latency
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.loader import load_trace
from marsched.workload.model import ApiCall, ApiType, Request, build_request, scale_api_time

FIRST_ID = 4  # ids 0-3 are <unk>, <s>, </s>, <pad> in `marsched model`'s tokenizer
BLOCK_TOKENS = 128  # vLLM's default block size on the CPU; blocks are counted in it
_GIB = 1 << 30

ProgressFn = Callable[[str, int, int], None]  # (what is running, done, total)


# --- the workload, without vLLM --------------------------------------------------------------


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def prompt_token_ids(request_id: str, count: int, vocab_size: int) -> list[int]:
    """`count` token ids in [4, vocab_size), the same for the same request id (any process, any run)."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocabulary of {vocab_size} ids has no room beyond the special ids 0-{FIRST_ID - 1}")
    return [int(t) for t in _rng(request_id).integers(FIRST_ID, vocab_size, size=max(count, 0))]


def return_token_ids(request_id: str, call_index: int, count: int, vocab_size: int) -> list[int]:
    """A call's returned ids: like `prompt_token_ids`, keyed by the request id and the call's index."""
    return prompt_token_ids(f"{request_id}/call{call_index}", count, vocab_size)


def _scaled(request: Request, factor: float) -> list[tuple[int, ApiCall | None]]:
    parts = []
    for segment in request.segments:
        api = segment.api
        if api is not None:
            api = ApiCall(api.api_type, api.duration_s, int(round(api.return_tokens * factor)))
        parts.append((max(1, int(round(segment.output_tokens * factor))), api))
    return parts


def _final_context(prompt: int, parts: list[tuple[int, ApiCall | None]]) -> int:
    """Tokens of the whole context at the end (a trailing call's return is never appended)."""
    total = prompt
    for index, (output, api) in enumerate(parts):
        total += output
        if api is not None and index < len(parts) - 1:
            total += api.return_tokens
    return total


def scale_request(request: Request, token_scale: float, max_context: int, api_time_scale: float = 1.0) -> Request:
    """The request as the bench runs it: token counts × `token_scale` (rounded; the prompt and each
    segment's output at least 1), shrunk further as a whole until the final context is at most
    `max_context`; API durations × `api_time_scale`. Raises ValueError if even one token per
    segment does not fit."""
    if not token_scale > 0 or not math.isfinite(token_scale):
        raise ValueError(f"--token-scale {token_scale:g}: give a finite number > 0")
    if not api_time_scale >= 0 or not math.isfinite(api_time_scale):
        raise ValueError(f"--api-time-scale {api_time_scale:g}: give a finite number >= 0")
    factor = token_scale
    for _ in range(60):
        prompt = max(1, int(round(request.prompt_tokens * factor)))
        parts = _scaled(request, factor)
        final = _final_context(prompt, parts)
        if final <= max_context:
            break
        factor *= min(max_context / final, 0.98)
    else:
        raise ValueError(f"request {request.request_id!r}: its {len(request.segments)} segments do not fit in "
                         f"{max_context} tokens even at one token each; raise --max-model-len or --kv-cache-gb")
    scaled = build_request(request.request_id, prompt, parts, request.arrival_s)
    return replace(scale_api_time(scaled, api_time_scale), template_id=request.template_id)


def bench_requests(templates: list[Request], qps: float, duration_s: float, seed: int, token_scale: float,
                   max_context: int, api_time_scale: float, max_requests: int | None = None) -> list[Request]:
    """The seeded Poisson stream, first `max_requests` kept, each request scaled (`scale_request`)."""
    stream = poisson_arrivals(templates, qps, duration_s, seed)
    if max_requests is not None:
        stream = stream[:max_requests]
    return [scale_request(r, token_scale, max_context, api_time_scale) for r in stream]


# --- the engine's capacity ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # bfloat16 | float32 | float16
    max_position: int
    vocab: int
    name: str

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "max_position": self.max_position,
                "vocab": self.vocab, "kv_bytes_per_token": self.kv_bytes_per_token}


def read_model(path: str | os.PathLike[str]) -> ModelInfo:
    """What the bench needs from a Hugging Face model directory's config.json; ValueError naming --model."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {path}: no config.json there; build a model with `marsched model --out DIR`") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {path}: cannot read config.json ({error})") from None
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return ModelInfo(str(path), int(config["num_hidden_layers"]), int(config.get("num_key_value_heads", heads)),
                         head_dim, dtype if dtype in ("float32", "float16") else "bfloat16",
                         int(config.get("max_position_embeddings", 2048)), int(config["vocab_size"]),
                         Path(path).resolve().name)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--model {path}: config.json lacks a Llama-like field ({error})") from None


def kv_blocks_for(gib: float, kv_bytes_per_token: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks of `block_tokens` tokens that `gib` GiB of KV cache hold (vLLM's num_gpu_blocks)."""
    if not gib > 0 or not math.isfinite(gib):
        raise ValueError(f"--kv-cache-gb {gib:g}: give a finite number of GiB > 0")
    blocks = int(gib * _GIB // (kv_bytes_per_token * block_tokens))
    if blocks < 2:
        raise ValueError(f"--kv-cache-gb {gib:g}: holds {blocks} block(s) of {block_tokens} tokens "
                         f"({kv_bytes_per_token} bytes per token); give at least "
                         f"{2 * kv_bytes_per_token * block_tokens / _GIB:.4f}")
    return blocks


# --- measurements -------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Objects of a JSONL file written by a process that may have been killed (a cut line is skipped)."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return rows


def fit_iteration(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares `step_s = c + a·tokens` over steps that scheduled something (a, c >= 0)."""
    tokens = np.array([s["tokens"] for s in steps if s["tokens"] > 0], dtype=float)
    times = np.array([s["step_s"] for s in steps if s["tokens"] > 0], dtype=float)
    if times.size == 0:
        return {"c_s": math.nan, "a_s_per_token": math.nan, "r2": math.nan, "steps": 0}
    if np.unique(tokens).size < 2:
        return {"c_s": float(np.median(times)), "a_s_per_token": 0.0, "r2": math.nan, "steps": int(times.size)}
    a, c = np.polyfit(tokens, times, 1)
    if a < 0:
        a, c = 0.0, float(np.median(times))
    if c < 0:
        a, c = float(np.sum(tokens * times) / np.sum(tokens * tokens)), 0.0
    residual = times - (c + a * tokens)
    spread = float(np.sum((times - times.mean()) ** 2))
    r2 = 1 - float(np.sum(residual ** 2)) / spread if spread > 0 else math.nan
    return {"c_s": float(c), "a_s_per_token": float(a), "r2": r2, "steps": int(times.size)}


def iteration_stats(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, mean, p50, p99 of the engine's step time and of the scheduler's share of it
    (`schedule_*`: inside `schedule()`, `update_*`: inside `update_from_output()`)."""
    busy = [s for s in steps if s["tokens"] > 0]
    stats: dict[str, Any] = {"count": len(busy), "idle_steps": len(steps) - len(busy)}
    for key, name in (("step_s", ""), ("sched_s", "schedule_"), ("update_s", "update_")):
        values = np.array([s.get(key, math.nan) for s in busy], dtype=float)
        for label, value in (("mean", values.mean() if values.size else math.nan),
                             ("p50", np.percentile(values, 50) if values.size else math.nan),
                             ("p99", np.percentile(values, 99) if values.size else math.nan)):
            stats[f"{name}{label}_s"] = float(value)
    decode = np.array([s["step_s"] for s in busy if s["prefill_seqs"] == 0], dtype=float)
    stats["decode_only_steps"] = int(decode.size)
    stats["decode_only_p50_s"] = float(np.percentile(decode, 50)) if decode.size else math.nan
    stats["tokens_mean"] = float(np.mean([s["tokens"] for s in busy])) if busy else math.nan
    stats["seqs_mean"] = float(np.mean([s["seqs"] for s in busy])) if busy else math.nan
    stats["ctx_mean"] = float(np.mean([s["ctx"] for s in busy])) if busy else math.nan
    stats["fit"] = fit_iteration(busy)
    return stats


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request (times are time.monotonic())."""

    request: Request  # as run: scaled tokens and durations
    planned_t: float
    submitted_t: float = math.nan
    first_token_t: float = math.nan
    finish_t: float = math.nan
    api_time_s: float = 0.0
    output_tokens: int = 0
    api_return_tokens: int = 0
    strategies: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and not math.isnan(self.finish_t)


def request_records(outcomes: list[Outcome], events: list[dict[str, Any]], t0: float,
                    cost: CostModel | None) -> list[RequestRecord]:
    """`RequestRecord`s of the finished requests, times relative to `t0`; the trace adds preemptions,
    the longest queue wait and the strategies each call ran under."""
    preempts: dict[str, int] = {}
    waits: dict[str, float] = {}
    strategies: dict[str, list[str]] = {}
    for event in events:
        rid = event.get("rid")
        if event["event"] == "preempt":
            preempts[rid] = preempts.get(rid, 0) + 1
        elif event["event"] == "admit":
            waits[rid] = max(waits.get(rid, 0.0), float(event.get("wait_s", 0.0)))
        elif event["event"] == "finish" and event.get("strategies") is not None:
            strategies[rid] = list(event["strategies"])
    records = []
    for o in outcomes:
        if not o.finished:
            continue
        rid = o.request.request_id
        isolated = isolated_latency(o.request, cost) if cost is not None else math.nan
        records.append(RequestRecord(
            rid, o.planned_t - t0, o.first_token_t - t0, o.finish_t - t0, o.api_time_s, o.request.prompt_tokens,
            o.output_tokens, o.api_return_tokens, preempts.get(rid, 0), waits.get(rid, 0.0), isolated,
            tuple(strategies.get(rid, o.strategies)),
        ))
    return records


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchSpec:
    model: str
    trace: str = "single"
    policies: tuple[str, ...] = ("vllm", "infercept", "mars")
    qps: tuple[float, ...] = (1.0,)
    duration_s: float = 60.0
    seed: int = 0
    api_time_scale: float = 1.0
    token_scale: float = 1.0
    kv_cache_gb: float | None = None  # None: VLLM_CPU_KVCACHE_SPACE as set, else 1 GiB
    max_requests: int | None = None
    max_model_len: int | None = None
    predictor: str = "oracle"
    api_estimator: str = "type-mean"
    strict: bool = False
    dtype: str = "auto"  # auto: the model's own (config.json)
    profile: str | None = None  # the plugin's cost model (a profile name or .json path); None: placeholders
    starvation: str = "default"  # MARS's starvation variant (`--starvation`); "default": the policy's own

    def check(self) -> None:
        from marsched.predict import parse_api_estimator, parse_length_predictor

        if not self.policies:
            raise ValueError(f"--policies {','.join(self.policies)!r}: name at least one of {', '.join(POLICY_NAMES)}")
        for policy in self.policies:
            if policy not in POLICY_NAMES:
                raise ValueError(f"--policies {policy}: unknown policy; valid: {', '.join(POLICY_NAMES)}")
            if policy in SIMULATOR_ONLY:
                raise ValueError(f"--policies {policy}: runs only in the simulator (marsched compare); "
                                 "on vLLM use infercept")
        for flag, value, check in (("--predictor", self.predictor, lambda: parse_length_predictor(self.predictor, 0)),
                                   ("--api-estimator", self.api_estimator,
                                    lambda: parse_api_estimator(self.api_estimator))):
            try:
                check()
            except ValueError as error:
                raise ValueError(f"{flag} {value}: {error}") from None
        for flag, value in (("--duration", self.duration_s), ("--token-scale", self.token_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} {value:g}: give a finite number > 0")
        if not all(math.isfinite(q) and q > 0 for q in self.qps) or not self.qps:
            raise ValueError(f"--qps {self.qps}: give finite arrival rates > 0")
        if not (math.isfinite(self.api_time_scale) and self.api_time_scale >= 0):
            raise ValueError(f"--api-time-scale {self.api_time_scale:g}: give a finite number >= 0")
        if self.kv_cache_gb is not None and not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
            raise ValueError(f"--kv-cache-gb {self.kv_cache_gb:g}: give a finite number of GiB > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests {self.max_requests}: give at least 1")
        if self.max_model_len is not None and self.max_model_len < 32:
            raise ValueError(f"--max-model-len {self.max_model_len}: give at least 32")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype {self.dtype}: valid: auto, bfloat16, float32")
        if self.starvation != "default":
            from marsched.policy.registry import starvation_config

            try:
                starvation_config(self.starvation)
            except ValueError as error:
                raise ValueError(f"--starvation {self.starvation}: {error}") from None
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed {self.seed}: give an integer from 0 to 2^32-1")
        if self.profile is not None:
            from marsched.vllm.config import profile_cost

            try:
                profile_cost(self.profile)
            except ValueError as error:
                raise ValueError(f"--profile {self.profile}: {error}") from None


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """How the engine is sized before it starts (capacity is read back from vLLM after)."""

    dtype: str
    max_model_len: int
    num_gpu_blocks: int | None  # None: vLLM sizes the cache from VLLM_CPU_KVCACHE_SPACE
    kv_space_gib: int | None  # VLLM_CPU_KVCACHE_SPACE to set (integer GiB), None: the one set


def plan_engine(spec: BenchSpec, model: ModelInfo) -> EnginePlan:
    dtype = model.dtype if spec.dtype == "auto" else spec.dtype
    if dtype == "float16":
        dtype = "bfloat16"  # vLLM's CPU build runs half precision as bf16
    info = replace(model, dtype=dtype)
    limit = model.max_position
    blocks = None
    # Without a size vLLM's CPU build reserves 92% of the machine's memory for the KV cache
    # (gpu_memory_utilization) and refuses to start when less is free: default to 1 GiB.
    space = None if "VLLM_CPU_KVCACHE_SPACE" in os.environ else 1
    if spec.kv_cache_gb is not None:
        blocks = kv_blocks_for(spec.kv_cache_gb, info.kv_bytes_per_token)
        space = max(1, math.ceil(spec.kv_cache_gb))
        limit = min(limit, (blocks - 1) * BLOCK_TOKENS)  # one request must fit alone; one block is vLLM's null
    if spec.max_model_len is not None:
        limit = min(limit, spec.max_model_len)
    return EnginePlan(dtype, limit, blocks, space)


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
    plan = plan_engine(spec, model)
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
    saved_env = {k: os.environ.get(k) for k in (ENV_VAR, "VLLM_CPU_KVCACHE_SPACE")}
    os.environ[ENV_VAR] = str(step_log)
    if plan.kv_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(plan.kv_space_gib)
    engine_kwargs: dict[str, Any] = {"dtype": plan.dtype, "enforce_eager": True, "block_size": BLOCK_TOKENS,
                                     "max_model_len": plan.max_model_len, "seed": spec.seed}
    if plan.num_gpu_blocks is not None:
        engine_kwargs["num_gpu_blocks_override"] = plan.num_gpu_blocks
    mars = {"predictor": spec.predictor, "api_estimator": spec.api_estimator, "seed": spec.seed,
            "starvation": spec.starvation}
    if spec.profile is not None:  # the engine core reads the file: an absolute path
        mars["profile"] = str(Path(spec.profile).absolute()) if Path(spec.profile).is_file() else spec.profile
    engine = AugmentedEngine(spec.model, policy=policy, tools=_tools(model.vocab), trace_path=str(trace_path),
                             mars=mars, scheduler_cls=STEP_TIMED_MARS, **engine_kwargs)
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
                        "bytes_per_token": replace(model, dtype=plan.dtype).kv_bytes_per_token,
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
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    wallclock = time.monotonic() - started_run
    try:
        if math.isnan(t0):
            return None, interrupted
        steps = [s for s in read_jsonl(step_log) if s["t"] >= t0]
        events = read_jsonl(trace_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    iteration = iteration_stats(steps)
    fit = iteration["fit"]
    cost = None
    if not math.isnan(fit["c_s"]):
        cost = CostModel(fit["a_s_per_token"], fit["c_s"], capacity["max_num_batched_tokens"], 1e9)
    records = request_records(outcomes, events, t0, cost)
    record = _record(spec, model, plan, policy, qps, requests, outcomes, records, iteration, capacity,
                     wallclock, interrupted or died)
    record.update(timings)
    if died:
        record["error"] = f"vLLM's engine died during {label}; see its log above"
    return record, interrupted or died


def _record(spec: BenchSpec, model: ModelInfo, plan: EnginePlan, policy: str, qps: float, requests: list[Request],
            outcomes: list[Outcome], records: list[RequestRecord], iteration: dict, capacity: dict,
            wallclock: float, interrupted: bool) -> dict[str, Any]:
    from marsched.bench.runner import policy_fields
    from marsched.vllm.config import MarsConfig

    rules = MarsConfig(policy=policy, predictor=spec.predictor, api_estimator=spec.api_estimator,
                       seed=spec.seed, profile=spec.profile, starvation=spec.starvation).build_policy(token_budget=max(capacity.get("max_num_batched_tokens", 1), 1))
    record: dict[str, Any] = {
        "engine": "vllm",
        "policy": policy,
        "profile": f"vllm-cpu:{model.name}",
        "trace": spec.trace,
        "qps": qps,
        "duration_s": spec.duration_s,
        "seed": spec.seed,
        **policy_fields(rules),
        "num_requests": len(requests),
        "partial": interrupted,
    }
    if records:
        record.update(summarize(records))
    else:
        record["num_finished"] = 0
    errors = sorted({o.error for o in outcomes if o.error})
    submitted = [o.submitted_t - o.planned_t for o in outcomes if not math.isnan(o.submitted_t)]
    record.update({
        "iterations": iteration["count"],
        "wallclock_s": wallclock,
        "iteration": iteration,
        "model": {**replace(model, dtype=plan.dtype).to_dict()},
        "kv_cache": capacity,
        "api_time_scale": spec.api_time_scale,
        "token_scale": spec.token_scale,
        "cost_profile": spec.profile,
        "isolated_source": "estimate: simulator isolated_latency() with c + a·tokens fitted to this run's steps",
        "client_lag_mean_s": float(np.mean(submitted)) if submitted else math.nan,
        "errors": errors[:5],
        "num_errors": sum(1 for o in outcomes if o.error),
    })
    return record
