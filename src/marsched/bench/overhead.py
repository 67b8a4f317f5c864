"""How much time MarsScheduler adds per engine step over vLLM's own scheduler, with many waiting requests.

For each number of waiting requests (default 100, 1,000, 10,000) and each scheduler, one fresh
in-process vLLM engine (`LLM`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor: scheduler and
worker in one process, no IPC in the timings) on a tiny random model. `max_num_seqs` (default 8)
caps the running batch, with KV blocks for that batch at its peak (as MARS's admission counts it),
so that every scheduler runs the same 8 decoding requests and all the others wait: the difference is
the schedulers' own cost, not a different batch. Requests generate `warmup + steps + 10` tokens
unless told otherwise, so none finishes while measured.

All requests are added, the engine is stepped `warmup` times, then `steps` times while the scheduler
logs the time inside `schedule()` and inside `update_from_output()` of every step
(`marsched.bench.steps`: the same timer wraps both schedulers). Per run: p50 and p99 (linear
interpolation between order statistics) of `schedule()`, of `update_from_output()` and of their sum
per step. Per (size, scheduler): the median over repeats of each statistic; per marsched policy: the
difference marsched - stock of each median.

**The KV connector** (`connector="on"`, the default) is the Swap connector as the serve path loads
it (`marsched.vllm.runtime.swap_connector_config`: `HostSwapConnector` from `marsched.vllm.kv_swap`,
role `kv_both`; marsched gets `MarsConfig.host_swap_tokens` of host memory), for every scheduler,
stock included, so the comparison is fair: each step builds the connector's metadata, and
MarsScheduler publishes its inspection snapshot on it (`marsched.vllm.snapshot`, when something
changed or every `PUBLISH_EVERY_S`); `snapshot_steps` counts the measured steps that carried one.
The snapshot's serialization to a worker in another process (the serve path on CPU) is outside
these timings: here the worker shares the process.

Schedulers: `stock` is vLLM 0.32's `Scheduler` (the CPU platform turns async scheduling off); each
marsched policy is `MarsScheduler` with that policy's defaults: `mars` (ranking, starvation clock,
predicted-peak admission), `vllm` (the plugin's bookkeeping in first-come-first-served order: what
the plugin costs without MARS's ranking). Each (scheduler, size) runs in its own process, size by
size, scheduler by scheduler, repeated `repeats` times. Timings on a shared machine are noisy.

The goal (issue 20): MarsScheduler (`mars`) adds at most 1 ms per step at p99 of `schedule()` +
`update_from_output()` with 10,000 waiting, connector on, median of 3 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from marsched.bench.options import check_positive, check_refresh_interval
from marsched.vllm.config import MarsConfig  # no vLLM import

STOCK = "stock"
CONNECTOR_CHOICES = ("on", "off")
BLOCK_TOKENS = 32
SLACK_TOKENS = 10  # tokens past the measured steps, so that no request finishes while measured
GOAL_WAITING = 10_000
GOAL_POLICY = "mars"
GOAL_LIMIT_MS = 1.0
HOST_SWAP_TOKENS = next(f.default for f in fields(MarsConfig) if f.name == "host_swap_tokens")
TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, max_position=1024)
# Per-run statistics, ms per step: the part timed, and the quantile.
PARTS = ("schedule", "update", "total")  # total: schedule() + update_from_output() of the same step
QUANTILES = {"p50": 0.5, "p99": 0.99}
STATS = tuple(f"{part}_{name}_ms" for part in PARTS for name in QUANTILES)
CONTEXT_STATS = ("step_p50_ms",)  # the engine's whole iteration, for the noise, not the overhead


@dataclass(frozen=True, slots=True)
class OverheadPlan:
    sizes: tuple[int, ...] = (100, 1000, 10000)
    policies: tuple[str, ...] = ("mars", "vllm")
    connector: str = "on"
    max_num_seqs: int = 8
    prompt: int = 48
    max_tokens: int = 0  # 0: warmup + steps + SLACK_TOKENS
    blocks: int = 0  # 0: enough for the batch at its peak
    refresh_interval: int = 1
    host_swap_tokens: int = HOST_SWAP_TOKENS  # marsched's host memory for swapped KV (MarsConfig's default)
    warmup: int = 10
    steps: int = 300
    repeats: int = 1

    @property
    def schedulers(self) -> tuple[str, ...]:
        return (STOCK, *self.policies)

    @property
    def tokens(self) -> int:
        return self.max_tokens or self.warmup + self.steps + SLACK_TOKENS

    @property
    def peak_blocks(self) -> int:
        """KV blocks for the batch at its peak as MARS's predicted-peak admission counts it (one more
        block per request for its partly filled last one, `Policy.admits_outlooks`), plus vLLM's
        null block: with fewer, MARS admits fewer than `max_num_seqs` and the batches differ."""
        return self.max_num_seqs * (-(-(self.prompt + self.tokens) // BLOCK_TOKENS) + 1) + 1

    @property
    def kv_blocks(self) -> int:
        return self.blocks or self.peak_blocks

    def check(self) -> None:
        """Raise ValueError naming the option; nothing is started."""
        if not self.sizes:
            raise ValueError("--sizes: give at least one number of waiting requests")
        for size in self.sizes:
            if size < 1:
                raise ValueError(f"--sizes: {size} waiting requests; give numbers >= 1")
        if STOCK in self.policies:
            raise ValueError(f"--policies {','.join(self.policies)}: '{STOCK}' is always measured; "
                             "name marsched policies only")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies {','.join(self.policies)}: a policy is named twice")
        for policy in self.policies:
            try:
                MarsConfig(policy=policy, host_swap_tokens=self.host_swap_tokens)
            except ValueError as error:
                raise ValueError(f"--policies {policy}: {error}") from None
        if self.connector not in CONNECTOR_CHOICES:
            raise ValueError(f"--connector {self.connector}: give one of {', '.join(CONNECTOR_CHOICES)}")
        for flag, value in (("--max-num-seqs", self.max_num_seqs), ("--prompt", self.prompt),
                            ("--steps", self.steps), ("--repeats", self.repeats),
                            ("--host-swap-tokens", self.host_swap_tokens)):
            check_positive(flag, value)
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}: give a number of steps >= 0")
        for flag, value in (("--max-tokens", self.max_tokens), ("--blocks", self.blocks)):
            if value < 0:
                raise ValueError(f"{flag} {value}: give a number >= 0 (0: the default)")
        check_refresh_interval(self.refresh_interval)
        if self.blocks and self.blocks < self.peak_blocks:
            raise ValueError(f"--blocks {self.blocks}: {self.max_num_seqs} requests of {self.prompt + self.tokens} "
                             f"tokens need {self.peak_blocks} blocks of {BLOCK_TOKENS} (null block included); "
                             "the batch must fit at its peak so that every scheduler runs the same requests")


def plan_from_args(args: argparse.Namespace) -> OverheadPlan:
    """The plan of the command line; ValueError naming the option."""
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--sizes {args.sizes}: give whole numbers separated by commas") from None
    plan = OverheadPlan(
        sizes=sizes, policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        connector=args.connector, max_num_seqs=args.max_num_seqs, prompt=args.prompt, max_tokens=args.max_tokens,
        blocks=args.blocks, refresh_interval=args.refresh_interval, host_swap_tokens=args.host_swap_tokens,
        warmup=args.warmup, steps=args.steps, repeats=args.repeats)
    plan.check()
    return plan


# --- statistics (pure) ------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q}: give a number from 0 to 1")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_stats(rows: list[dict[str, Any]]) -> dict[str, float]:
    """p50 and p99 (ms) of each part of a run's step log rows (`sched_s`, `update_s`, `step_s`)."""
    if not rows:
        raise ValueError("no measured steps in the step log")
    parts = {"schedule": [r["sched_s"] for r in rows], "update": [r["update_s"] for r in rows]}
    parts["total"] = [s + u for s, u in zip(parts["schedule"], parts["update"])]
    stats = {f"{part}_{name}_ms": quantile(parts[part], q) * 1e3 for part in PARTS for name, q in QUANTILES.items()}
    stats["step_p50_ms"] = quantile([r["step_s"] for r in rows], 0.5) * 1e3
    return stats


def snapshot_steps(rows: list[dict[str, Any]], published: list[float]) -> list[int]:
    """Indices of the rows (sorted by `t`, the start of `schedule()`) whose step published a snapshot
    at one of the times `published` (the publication happens inside that step's `schedule()`)."""
    starts = [r["t"] for r in rows]
    found = {bisect_right(starts, t) - 1 for t in published}
    return sorted(i for i in found if i >= 0)


def summarize(runs: list[dict[str, Any]], plan: OverheadPlan) -> list[dict[str, Any]]:
    """Per (size, scheduler): the median over repeats of each statistic, and its range."""
    summary = []
    for waiting in plan.sizes:
        for scheduler in plan.schedulers:
            rows = [r for r in runs if r["waiting"] == waiting and r["scheduler"] == scheduler]
            if not rows:
                raise ValueError(f"no run of {scheduler} with {waiting} waiting")
            entry: dict[str, Any] = {"waiting": waiting, "scheduler": scheduler, "repeats": len(rows),
                                     "running": sorted({r["running"] for r in rows})}
            for key in (*STATS, *CONTEXT_STATS):
                values = [r[key] for r in rows]
                entry[key] = statistics.median(values)
                entry[f"{key}_range"] = [min(values), max(values)]
            entry["snapshot_steps"] = statistics.median(r["snapshot_steps"] for r in rows)
            summary.append(entry)
    return summary


def overheads(runs: list[dict[str, Any]], summary: list[dict[str, Any]], plan: OverheadPlan) -> list[dict[str, Any]]:
    """Per (size, policy): marsched - stock of each median, and the paired difference of each repeat."""
    by = {(s["waiting"], s["scheduler"]): s for s in summary}
    result = []
    for waiting in plan.sizes:
        stock = by[(waiting, STOCK)]
        for policy in plan.policies:
            mars = by[(waiting, policy)]
            entry: dict[str, Any] = {"waiting": waiting, "policy": policy,
                                     "same_batch": mars["running"] == stock["running"]}
            for key in STATS:
                entry[key] = mars[key] - stock[key]
                entry[f"{key}_per_repeat"] = [_run(runs, waiting, policy, r)[key] - _run(runs, waiting, STOCK, r)[key]
                                              for r in range(plan.repeats)]
            result.append(entry)
    return result


def _run(runs: list[dict[str, Any]], waiting: int, scheduler: str, repeat: int) -> dict[str, Any]:
    for run in runs:
        if run["waiting"] == waiting and run["scheduler"] == scheduler and run["repeat"] == repeat:
            return run
    raise ValueError(f"no run of {scheduler} with {waiting} waiting in repeat {repeat}")


def goal(added: list[dict[str, Any]], connector: str) -> dict[str, Any] | None:
    """The issue's goal, where the runs measured it: `mars` adds <= 1 ms at p99 with 10,000 waiting,
    connector on."""
    if connector != "on":
        return None
    for entry in added:
        if entry["waiting"] == GOAL_WAITING and entry["policy"] == GOAL_POLICY:
            value = entry["total_p99_ms"]
            return {"waiting": GOAL_WAITING, "policy": GOAL_POLICY, "statistic": "total_p99_ms",
                    "added_ms": value, "limit_ms": GOAL_LIMIT_MS, "met": value <= GOAL_LIMIT_MS}
    return None


def format_table(summary: list[dict[str, Any]], added: list[dict[str, Any]], plan: OverheadPlan) -> str:
    """The report: per size, stock, each marsched policy, and each policy's difference."""
    by = {(s["waiting"], s["scheduler"]): s for s in summary}
    diff = {(a["waiting"], a["policy"]): a for a in added}
    head = (f"{'waiting':>8} {'scheduler':>12} " + " ".join(f"{part + ' ' + name:>12}" for part in
                                                        ("schedule()", "update", "sum") for name in QUANTILES)
            + f" {'step p50':>9} {'snapshots':>9}")
    lines = [f"ms per step, p50/p99 over {plan.steps} steps, median of {plan.repeats} repeat(s); connector "
             f"{plan.connector}; {plan.max_num_seqs} running, {plan.kv_blocks} blocks of {BLOCK_TOKENS} tokens; "
             f"refresh_interval {plan.refresh_interval}", head]
    for waiting in plan.sizes:
        for scheduler in plan.schedulers:
            s = by[(waiting, scheduler)]
            lines.append(f"{waiting:>8} {scheduler:>12} " + " ".join(f"{s[k]:>12.3f}" for k in STATS)
                         + f" {s['step_p50_ms']:>9.2f} {s['snapshot_steps']:>9g}")
        for policy in plan.policies:
            a = diff[(waiting, policy)]
            label = f"{policy}-{STOCK}"
            note = "" if a["same_batch"] else "  (batches differ: not comparable)"
            lines.append(f"{waiting:>8} {label:>12} " + " ".join(f"{a[k]:>+12.3f}" for k in STATS) + note)
    met = goal(added, plan.connector)
    if met is not None:
        lines.append(f"goal: {GOAL_POLICY} adds {met['added_ms']:+.3f} ms at p99 per step with {GOAL_WAITING} "
                     f"waiting (limit {GOAL_LIMIT_MS:g} ms): {'met' if met['met'] else 'NOT met'}")
    return "\n".join(lines)


# --- one run (child process, imports vLLM) -----------------------------------------------------


def measure(model: str, scheduler: str, waiting: int, plan: OverheadPlan, profile: str | None = None) -> dict[str, Any]:
    """One engine, `waiting` requests, the scheduler's per-step times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from marsched.bench.steps import ENV_VAR, STEP_TIMED_MARS, STEP_TIMED_VLLM

    log = Path(tempfile.mkdtemp(prefix="overhead-")) / "steps.jsonl"
    os.environ[ENV_VAR] = str(log)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from marsched.bench.records import read_jsonl
    from marsched.bench.stream import prompt_token_ids
    from marsched.vllm.runtime import swap_connector_config

    kwargs: dict[str, Any] = {}
    if plan.connector == "on":
        kwargs["kv_transfer_config"] = swap_connector_config()
    if scheduler == STOCK:
        kwargs["scheduler_cls"] = STEP_TIMED_VLLM
    else:
        kwargs["scheduler_cls"] = STEP_TIMED_MARS
        kwargs["additional_config"] = MarsConfig(policy=scheduler, refresh_interval=plan.refresh_interval,
                                                 host_swap_tokens=plan.host_swap_tokens).additional_config()
    load_start = os.getloadavg()[0]
    begin = time.monotonic()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_TOKENS,
              max_model_len=plan.prompt + plan.tokens, num_gpu_blocks_override=plan.kv_blocks,
              max_num_seqs=plan.max_num_seqs, enable_prefix_caching=False, seed=0,
              distributed_executor_backend="uni", **kwargs)
    start_s = time.monotonic() - begin
    engine = llm.llm_engine
    core = engine.engine_core.engine_core.scheduler
    connector = type(core.connector).__name__ if core.connector is not None else None
    vocab = engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=plan.tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    begin = time.monotonic()
    for i in range(waiting):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt_token_ids(f"r{i}", plan.prompt, vocab)),
                           params)
    add_s = time.monotonic() - begin
    for _ in range(plan.warmup):
        engine.step()
    profiler = _profile(core) if profile else None
    published: list[float] = []
    last_published = getattr(core, "_published_t", None)  # MarsScheduler's time of its last snapshot
    start = time.monotonic()
    for _ in range(plan.steps):
        engine.step()
        now_published = getattr(core, "_published_t", None)
        if now_published != last_published:
            published.append(now_published)
            last_published = now_published
    steps_s = time.monotonic() - start
    core._flush_steps(time.monotonic())
    if profiler is not None:
        profiler.dump_stats(profile)
    rows = sorted((r for r in read_jsonl(log) if r["t"] >= start), key=lambda r: r["t"])
    shutil.rmtree(log.parent, ignore_errors=True)
    published_in = snapshot_steps(rows, published)
    return {
        "scheduler": scheduler, "waiting": waiting, "connector": connector, "steps": len(rows),
        "running": len(core.running), "waiting_after": len(core.waiting),
        **step_stats(rows), "snapshot_steps": len(published_in),
        # schedule() of the steps that built a snapshot (None: none did), against `schedule_p50_ms`
        "snapshot_schedule_p50_ms": quantile([rows[i]["sched_s"] for i in published_in], 0.5) * 1e3
        if published_in else None,
        "start_s": start_s, "add_requests_s": add_s, "steps_s": steps_s, "load_average": [load_start, os.getloadavg()[0]],
        "vllm": vllm.__version__,
    }


def _profile(core: Any) -> Any:
    """cProfile around every `schedule()` and `update_from_output()` of `core` from now on (its
    timings then include the profiler's)."""
    import cProfile

    profiler = cProfile.Profile()

    def profiled(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            profiler.enable()
            try:
                return method(*args, **kwargs)
            finally:
                profiler.disable()
        return call

    # The engine core calls `self.scheduler.schedule()`: an instance attribute wins over the class's.
    core.schedule = profiled(core.schedule)
    core.update_from_output = profiled(core.update_from_output)
    return profiler


# --- the whole benchmark (parent process) -------------------------------------------------------


def child_command(plan: OverheadPlan, model: str, scheduler: str, waiting: int, profile: str | None) -> list[str]:
    command = [sys.executable, "-m", "marsched.bench.overhead", "--one", f"{scheduler}:{waiting}", "--model", model,
               "--sizes", str(waiting), "--policies", ",".join(plan.policies) or "mars", "--connector", plan.connector,
               "--blocks", str(plan.kv_blocks), "--prompt", str(plan.prompt), "--max-tokens", str(plan.tokens),
               "--max-num-seqs", str(plan.max_num_seqs), "--warmup", str(plan.warmup), "--steps", str(plan.steps),
               "--refresh-interval", str(plan.refresh_interval), "--host-swap-tokens", str(plan.host_swap_tokens)]
    return command + (["--profile", profile] if profile else [])


def run_all(plan: OverheadPlan, model: str, profile: str | None = None, echo: Any = print) -> list[dict[str, Any]]:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the directory that holds `marsched`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    runs = []
    for repeat in range(plan.repeats):
        for waiting in plan.sizes:
            for scheduler in plan.schedulers:
                where = None
                if profile:
                    where = str(Path(profile) / f"{scheduler}-{waiting}-r{repeat}.prof")
                begin = time.monotonic()
                done = subprocess.run(child_command(plan, model, scheduler, waiting, where), capture_output=True,
                                      text=True, env=env)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    raise RuntimeError(f"{scheduler} with {waiting} waiting failed (exit {done.returncode}):\n"
                                       f"{done.stderr[-3000:]}")
                result = json.loads(lines[-1][len("RESULT "):]) | {"repeat": repeat,
                                                                   "wall_s": time.monotonic() - begin}
                runs.append(result)
                echo(f"  [{repeat + 1}/{plan.repeats}] {scheduler:>6} {waiting:>6} waiting: sum p50 "
                     f"{result['total_p50_ms']:.3f} p99 {result['total_p99_ms']:.3f} ms, step "
                     f"{result['step_p50_ms']:.2f} ms ({result['running']} running, {result['waiting_after']} "
                     f"waiting, {result['snapshot_steps']} snapshots; start {result['start_s']:.0f} s, add "
                     f"{result['add_requests_s']:.1f} s, load {result['load_average'][0]:.1f})", flush=True)
    return runs


def report(plan: OverheadPlan, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: the plan, every run, the medians, the differences and the goal."""
    summary = summarize(runs, plan)
    added = overheads(runs, summary, plan)
    loads = [x for r in runs for x in r["load_average"]]
    return {"plan": asdict(plan) | {"max_tokens": plan.tokens, "blocks": plan.kv_blocks},
            "machine": {"cpus": os.cpu_count(), "load_average": [min(loads), max(loads)],
                        "vllm": runs[0]["vllm"] if runs else None},
            "runs": runs, "summary": summary, "overhead": added, "goal": goal(added, plan.connector)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000,10000", help="numbers of waiting requests")
    p.add_argument("--policies", default="mars,vllm",
                   help="marsched policies (MarsScheduler) to compare with vLLM's own scheduler ('stock')")
    p.add_argument("--connector", choices=CONNECTOR_CHOICES, default="on",
                   help="the Swap KV connector (HostSwapConnector) for every scheduler, as the serve path loads it")
    p.add_argument("--model", help="model directory (default: a tiny random model built in a temp dir)")
    p.add_argument("--blocks", type=int, default=0, help="KV cache blocks of 32 tokens (default: the batch's peak)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="running requests at most (vLLM's max_num_seqs): the same batch for every scheduler")
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=0,
                   help=f"tokens each request generates (default: warmup + steps + {SLACK_TOKENS})")
    p.add_argument("--refresh-interval", type=int, default=1,
                   help="marsched's refresh_interval: recompute waiting requests' keys every k steps")
    p.add_argument("--host-swap-tokens", type=int, default=HOST_SWAP_TOKENS,
                   help="marsched's host memory for swapped KV, in tokens (MarsConfig.host_swap_tokens)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=300, help="measured steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (size, scheduler); the median is reported")
    p.add_argument("--json", help="write the plan, every run, the medians and the differences here")
    p.add_argument("--profile", help="directory for a cProfile of schedule() and update_from_output() in each run "
                   "(inflates its timings)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: SCHEDULER:WAITING
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.one:
        scheduler, _, waiting = args.one.partition(":")
        result = measure(args.model, scheduler, int(waiting), plan, args.profile)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    model, built = args.model, None
    if model is None:
        from marsched.bench.model import ModelShape, build_model

        built = Path(tempfile.mkdtemp(prefix="overhead-model-"))
        model = str(built / "tiny")
        build_model(model, ModelShape(**TINY, dtype="float32"))
    try:
        runs = run_all(plan, model, args.profile)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
    document = report(plan, runs)
    print()
    print(format_table(document["summary"], document["overhead"], plan))
    print(f"load average during the runs: {document['machine']['load_average'][0]:.1f}-"
          f"{document['machine']['load_average'][1]:.1f} on {document['machine']['cpus']} cores")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"runs: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
