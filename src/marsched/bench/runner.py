"""Run simulations: one (policy, QPS) point, or a grid of them in parallel processes."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from marsched.metrics.records import summarize
from marsched.metrics.trace import EventTrace, TraceFile
from marsched.policy.policy import Policy
from marsched.policy.boost import DEFAULT_BOOST_GAMMA
from marsched.policy.nudge import DEFAULT_NUDGE_M
from marsched.policy.program_rest import DEFAULT_REST, RestRule
from marsched.policy.registry import make_policy, starvation_variant
from marsched.predict.api_duration import parse_api_estimator
from marsched.predict.length import FOREKNOWLEDGE, parse_length_predictor, prepare_length_predictor
from marsched.predict.online import DEFAULT_API_ESTIMATOR, DEFAULT_PREDICTOR
from marsched.predict.segment import SegmentPredictor
from marsched.sim.cluster import parse_routing, simulate_cluster
from marsched.sim.engine import Simulator
from marsched.sim.select import make_simulator
from marsched.sim.profile import load_profile, scale_kv_capacity
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.loader import load_trace
from marsched.workload.model import Request, scale_api_time
from marsched.workload.sessions import session_arrivals
from marsched.workload.token_scale import check_token_scale, scale_tokens

_DEFAULT = "default"
ARRIVALS = ("poisson", "sessions")
# Session arrivals go on past the measured window until every task that arrived in it has ended,
# for at most this many windows more (sim/cluster.py).
SESSION_TAIL_WINDOWS = 3


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything that defines one simulated run; the same spec gives the same result."""

    policy: str
    qps: float
    trace: str = "bundled"
    profile: str = "gptj-6b-a100"
    duration_s: float = 600.0
    seed: int = 0
    predictor: str = DEFAULT_PREDICTOR
    api_estimator: str = DEFAULT_API_ESTIMATOR
    starvation_threshold: int | None | str = _DEFAULT  # "default": the policy's own
    refresh_interval: int = 1
    trace_out: str | None = None
    strict: bool = False  # reject trace values the loader would otherwise read leniently, with a warning
    starvation: str = _DEFAULT  # a starvation variant name, or "default": the policy's own
    admission: str = _DEFAULT  # greedy | predicted-peak, or "default": the policy's own
    kv_scale: float = 1.0  # × the profile's device KV blocks (regime maps)
    api_time_scale: float = 1.0  # × every API call's duration (regime maps)
    token_scale: float = 1.0  # × every token count of the trace (long contexts on small profiles)
    replicas: int = 1  # engines of the profile behind a router (sim/cluster.py)
    routing: str = "least-loaded"  # the router's rule, with replicas > 1
    prefix_cache: bool = True  # the engine keeps freed blocks' content (vLLM V1); off: vLLM 0.2's engine
    # poisson: `qps` tasks/s, each its own conversation; sessions: `qps` conversations started per
    # second, replayed task by task (workload/sessions.py), measured over `duration_s` after `warmup_s`
    arrivals: str = "poisson"
    warmup_s: float = 0.0
    # What the key knows past a request's current segment (`policy/program_rest.py`); the
    # `foreknowledge` predictor reads the plan instead (a bound).
    rest: str = DEFAULT_REST
    boost_gamma: float = DEFAULT_BOOST_GAMMA  # γ of mars-boost's order, per device second (`policy/boost.py`)
    nudge_m: int = DEFAULT_NUDGE_M  # mars-nudge's window: the last M waiting requests (`policy/nudge.py`)

    def build(self):
        """Profile and policy for this spec; raises ValueError naming what is wrong."""
        check_token_scale(self.token_scale)
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas}: give 1 or more")
        parse_routing(self.routing)
        if self.replicas > 1 and self.trace_out:
            raise ValueError("--trace-out writes one engine's trace; it cannot be given with --replicas > 1")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"--arrivals {self.arrivals!r}: give one of {', '.join(ARRIVALS)}")
        if self.arrivals == "sessions" and self.trace_out:
            raise ValueError("--trace-out cannot be given with --arrivals sessions (they run as a cluster)")
        if isinstance(self.warmup_s, bool) or not isinstance(self.warmup_s, (int, float)) \
                or not math.isfinite(self.warmup_s) or self.warmup_s < 0:
            raise ValueError(f"--warmup {self.warmup_s!r}: give a number of seconds >= 0")
        if self.warmup_s and self.arrivals != "sessions":
            raise ValueError("--warmup applies to --arrivals sessions only")
        profile = scale_kv_capacity(load_profile(self.profile), self.kv_scale)
        bound = self.predictor == FOREKNOWLEDGE  # lengths, calls and later segments from the trace
        predictor = SegmentPredictor(parse_length_predictor(self.predictor, self.seed),
                                     parse_api_estimator("oracle" if bound else self.api_estimator))
        extra = {} if self.starvation_threshold == _DEFAULT else {"starvation_threshold": self.starvation_threshold}
        if self.starvation != _DEFAULT:
            extra["starvation"] = self.starvation
        if self.admission != _DEFAULT:
            extra["admission"] = self.admission
        policy = make_policy(self.policy, profile.cost, predictor, refresh_interval=self.refresh_interval,
                             prefix_cache=self.prefix_cache, rest=RestRule.PLAN if bound else self.rest,
                             boost_gamma=self.boost_gamma, nudge_m=self.nudge_m, **extra)
        return profile, policy


def run_one(spec: RunSpec, templates: list[Request] | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Simulate one spec and return its metrics record (the keys of the JSON output)."""
    templates = templates if templates is not None else load_trace(spec.trace, strict=spec.strict)
    profile, policy = spec.build()
    if spec.token_scale != 1:  # before anything learns from the templates: predictors see what runs
        templates = [scale_tokens(t, spec.token_scale) for t in templates]
    prepare_length_predictor(policy.predictor.length, templates, spec.trace)

    def replica() -> Simulator:
        replica_profile, replica_policy = spec.build()  # a policy (and predictor) of its own
        prepare_length_predictor(replica_policy.predictor.length, templates, spec.trace)
        return make_simulator([], replica_profile, replica_policy)

    extra: dict = {}
    if spec.arrivals == "sessions":
        runs = [scale_api_time(t, spec.api_time_scale) for t in templates]  # gaps are people's time: unscaled
        stream = session_arrivals(runs, spec.qps, spec.warmup_s + (1 + SESSION_TAIL_WINDOWS) * spec.duration_s,
                                  spec.seed)
        result = simulate_cluster(stream, replica, spec.replicas, parse_routing(spec.routing), on_progress,
                                  window=(spec.warmup_s, spec.warmup_s + spec.duration_s))
        arrived = result.arrived
        extra = {"arrivals": "sessions", "warmup_s": spec.warmup_s, "sessions": stream.sessions,
                 "num_measured": len(result.measured or ())}
    else:
        requests = poisson_arrivals(templates, spec.qps, spec.duration_s, spec.seed)
        if spec.api_time_scale != 1:  # after sampling: the same arrivals and shapes at every scale
            requests = [scale_api_time(r, spec.api_time_scale) for r in requests]
        arrived = len(requests)
        if spec.replicas > 1:
            result = simulate_cluster(requests, replica, spec.replicas, parse_routing(spec.routing), on_progress)
        else:
            trace = TraceFile(spec.trace_out) if spec.trace_out else EventTrace()
            try:
                result = make_simulator(requests, profile, policy, trace=trace, on_progress=on_progress).run()
            except BaseException:
                trace.abort()
                raise
            trace.close()
    record = {
        "engine": "sim",
        "policy": spec.policy,
        "profile": profile.name,
        "trace": spec.trace,
        "qps": spec.qps,
        "duration_s": spec.duration_s,
        "seed": spec.seed,
        "kv_scale": spec.kv_scale,
        "api_time_scale": spec.api_time_scale,
        "token_scale": spec.token_scale,
        **policy_fields(policy),
        "prefix_cache": policy.prefix_cache,
        "num_requests": arrived,
        **extra,
    }
    record.update(summarize(result.records))
    if spec.replicas > 1 or spec.arrivals == "sessions":
        record.update(replicas=spec.replicas, routing=spec.routing, routed_per_replica=result.routed,
                      iterations=sum(r.iterations for r in result.replicas),
                      reused_tokens=sum(r.reused_blocks for r in result.replicas) * profile.block_tokens,
                      carried_tokens=sum(r.carried_blocks for r in result.replicas) * profile.block_tokens,
                      shared_tokens=sum(r.shared_blocks for r in result.replicas) * profile.block_tokens)
    else:
        record.update(iterations=result.iterations, reused_tokens=result.reused_blocks * profile.block_tokens,
                      carried_tokens=result.carried_blocks * profile.block_tokens,
                      shared_tokens=result.shared_blocks * profile.block_tokens)
    record["wallclock_s"] = result.wallclock_s
    return record


def policy_fields(policy: Policy) -> dict:
    """The keys of a metrics record that say how the policy was set up (simulated or real engine)."""
    return {
        "predictor": policy.predictor.name,
        "rest": policy.rest.value,
        **({} if policy.boost_gamma is None else {"boost_gamma": policy.boost_gamma}),
        **({} if policy.nudge_m is None else {"nudge_m": policy.nudge_m}),
        # Whether the run read what a server cannot know (a segment's own length or call, or the
        # segments to come): then it is a bound, never MARS's number.
        "bound": policy.knows_future or not policy.predictor.knowable,
        "starvation": starvation_variant(policy.starvation),
        "starvation_threshold": policy.starvation.threshold,
        "starvation_fcfs_multiple": policy.starvation.fcfs_multiple,
        "admission": policy.admission.value,
        "refresh_interval": policy.refresh_interval,
    }


_worker_templates: dict[str, list[Request]] = {}


def _run_in_worker(spec: RunSpec) -> dict:
    if spec.trace not in _worker_templates:
        _worker_templates[spec.trace] = load_trace(spec.trace, strict=spec.strict)
    return run_one(spec, _worker_templates[spec.trace])


def run_grid(specs: list[RunSpec], workers: int | None = None,
             on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every spec, in parallel processes when there are several; records come back in spec order."""
    for spec in specs:
        spec.build()  # fail on a bad name before any process starts
    workers = workers or min(len(specs), os.cpu_count() or 1)
    if workers <= 1 or len(specs) == 1:
        records = []
        for spec in specs:
            records.append(_run_in_worker(spec))
            if on_done:
                on_done(records[-1])
        return records
    records: list[dict | None] = [None] * len(specs)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_in_worker, spec): index for index, spec in enumerate(specs)}
        for future in as_completed(futures):
            records[futures[future]] = future.result()
            if on_done:
                on_done(records[futures[future]])
    return records


def grid(base: RunSpec, policies: list[str], qps_values: list[float]) -> list[RunSpec]:
    return [replace(base, policy=policy, qps=qps) for qps in qps_values for policy in policies]


