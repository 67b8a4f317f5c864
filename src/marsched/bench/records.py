"""What a bench point measured, turned into the metrics record `compare` writes (`engine: "vllm"`).

- `Outcome`: what the client saw of one request (planned, submitted, first token, finish);
- `request_records`: `RequestRecord`s of the finished requests, with preemptions, the longest
  queue wait and each call's strategy from the scheduler's event trace;
- `iteration_stats`: the engine's steps during the run (`bench.steps`' log), with the fit
  `step_s = c + a·tokens` (`fit_iteration`) that estimates each request's isolated latency
  (the simulator's `isolated_latency` under that cost);
- `bench_record`: the point's record, summarized by `metrics.records.summarize`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from marsched.bench.fit import fit_line
from marsched.bench.model import ModelInfo
from marsched.metrics.records import RequestRecord, summarize
from marsched.policy.cost_model import CostModel
from marsched.sim.isolated import isolated_latency
from marsched.workload.model import Request

if TYPE_CHECKING:
    from marsched.bench.engine_config import EnginePlan
    from marsched.bench.spec import BenchSpec


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
    """Least squares `step_s = c + a·tokens` (a, c >= 0: `fit.fit_line`) over steps that scheduled
    something; with one token count (or fewer than 3 steps) `c` is the median step and `a` 0."""
    busy = [s for s in steps if s["tokens"] > 0]
    tokens = [float(s["tokens"]) for s in busy]
    times = [float(s["step_s"]) for s in busy]
    if not times:
        return {"c_s": math.nan, "a_s_per_token": math.nan, "r2": math.nan, "steps": 0}
    if len(set(tokens)) < 2 or len(times) < 3:
        return {"c_s": float(statistics.median(times)), "a_s_per_token": 0.0, "r2": math.nan, "steps": len(times)}
    line = fit_line(tokens, times)
    return {"c_s": line.intercept, "a_s_per_token": line.slope, "r2": line.quality.r2, "steps": len(times)}


def iteration_cost(fit: dict[str, float], token_budget: int) -> CostModel | None:
    """The cost model of a run's fitted steps (None when nothing was fitted)."""
    if math.isnan(fit["c_s"]):
        return None
    return CostModel(fit["a_s_per_token"], fit["c_s"], token_budget, 1e9)


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


def bench_record(spec: BenchSpec, model: ModelInfo, plan: EnginePlan, policy: str, qps: float,
                 requests: list[Request], outcomes: list[Outcome], records: list[RequestRecord], iteration: dict,
                 capacity: dict, wallclock: float, interrupted: bool) -> dict[str, Any]:
    """The metrics record of one point: `compare`'s keys, then the run's own (steps, model, KV cache)."""
    from marsched.bench.runner import policy_fields
    from marsched.vllm.config import MarsConfig

    rules = MarsConfig(policy=policy, predictor=spec.predictor, api_estimator=spec.api_estimator,
                       seed=spec.seed, profile=spec.profile, starvation=spec.starvation).build_policy(
        token_budget=max(capacity.get("max_num_batched_tokens", 1), 1))
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
        "model": {**plan.engine_model(model).to_dict()},
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
