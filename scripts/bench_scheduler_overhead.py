"""How much time MarsScheduler adds per engine step over vLLM's own scheduler, with many waiting requests.

For each number of waiting requests (default 100, 1,000, 10,000) and each scheduler, one fresh
in-process vLLM engine (`LLM`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`: scheduler and worker in one
process, no IPC in the timings) on a tiny random model. `max_num_seqs` (default 8) caps the
running batch, with KV blocks enough for that batch at its peak, so that every scheduler runs the
same 8 decoding requests and all the others wait: the difference between two schedulers is then
their own cost, not a different batch (with memory as the limit, MARS's predicted-peak admission
runs fewer requests than vLLM's greedy one and the step times are not comparable). All requests
are added, the engine is stepped `--warmup` times, then `--steps` times while the scheduler logs
the time spent inside `schedule()` and inside `update_from_output()` of every step
(`marsched.bench.steps`: the same timer wraps both schedulers). Reported: the median over the
measured steps, per scheduler, and the difference MarsScheduler - vLLM. The goal (issue 11):
under 1 ms per step at 1,000 waiting.

Schedulers: `stock` is vLLM 0.32's default (`vllm.v1.core.sched.scheduler.Scheduler`; the CPU
platform turns async scheduling off); each marsched policy is `MarsScheduler` (built on vLLM's
`AsyncScheduler`) with that policy's defaults, no KV connector (both engines run without one):
`mars` (ranking, starvation clock, predicted-peak admission), `vllm` (the plugin's bookkeeping
with first-come-first-served order: what the plugin costs without MARS's ranking).

Each (scheduler, size) runs in its own process, in the order size by size, scheduler by
scheduler, repeated `--repeats` times; the table shows the median over repeats of the per-run
medians. Timings on a shared machine are noisy: compare the two columns of one row, not rows
measured at different times.

    .venv/bin/python scripts/bench_scheduler_overhead.py [--sizes 100,1000,10000] [--json OUT]
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
from pathlib import Path

STOCK = "marsched.bench.steps.StepTimedScheduler"  # vLLM's own scheduler, with the same step timer
MARS = "marsched.bench.steps.StepTimedMarsScheduler"
TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, max_position=1024)


def measure(model: str, scheduler: str, waiting: int, blocks: int, prompt: int, max_tokens: int, max_seqs: int,
            warmup: int, steps: int, refresh_interval: int = 1) -> dict:
    """One engine, `waiting` requests, the scheduler's per-step times (runs in a child process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    log = Path(tempfile.mkdtemp(prefix="overhead-")) / "steps.jsonl"
    os.environ["MARSCHED_STEP_LOG"] = str(log)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from marsched.bench.real import prompt_token_ids, read_jsonl
    from marsched.vllm.config import MarsConfig

    block_tokens = 32
    max_len = prompt + max_tokens
    if max_seqs * -(-max_len // block_tokens) > blocks - 1:  # vLLM keeps one block back (the null block)
        raise SystemExit(f"--blocks {blocks}: {max_seqs} requests of {max_len} tokens need more; the batch "
                         "must fit at its peak so that every scheduler runs the same requests")
    kwargs = {}
    if scheduler == "stock":
        kwargs["scheduler_cls"] = STOCK
    else:
        kwargs["scheduler_cls"] = MARS
        kwargs["additional_config"] = MarsConfig(policy=scheduler, refresh_interval=refresh_interval).additional_config()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=block_tokens, max_model_len=max_len,
              num_gpu_blocks_override=blocks, max_num_seqs=max_seqs, enable_prefix_caching=False, seed=0, **kwargs)
    engine = llm.llm_engine
    core_scheduler = engine.engine_core.engine_core.scheduler
    vocab = engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    begin = time.monotonic()
    for i in range(waiting):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt_token_ids(f"r{i}", prompt, vocab)), params)
    add_s = time.monotonic() - begin
    for _ in range(warmup):
        engine.step()
    start = time.monotonic()
    for _ in range(steps):
        engine.step()
    core_scheduler._flush_steps(time.monotonic())
    rows = [r for r in read_jsonl(log) if r["t"] >= start]
    shutil.rmtree(log.parent, ignore_errors=True)
    sched = [r["sched_s"] for r in rows]
    update = [r["update_s"] for r in rows]
    return {
        "scheduler": scheduler, "waiting": waiting, "steps": len(rows),
        "running": len(core_scheduler.running), "waiting_after": len(core_scheduler.waiting),
        "schedule_median_ms": statistics.median(sched) * 1e3, "schedule_p90_ms": _quantile(sched, 0.9) * 1e3,
        "update_median_ms": statistics.median(update) * 1e3,
        "step_median_ms": statistics.median(r["step_s"] for r in rows) * 1e3,
        "add_requests_s": add_s,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="numbers of waiting requests")
    parser.add_argument("--policies", default="mars,vllm",
                        help="marsched policies (MarsScheduler) to compare with vLLM's own scheduler ('stock')")
    parser.add_argument("--model", help="model directory (default: a tiny random model built in a temp dir)")
    parser.add_argument("--blocks", type=int, default=80, help="KV cache blocks of 32 tokens")
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="running requests at most (vLLM's max_num_seqs): the same batch for every scheduler")
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens each request generates")
    parser.add_argument("--refresh-interval", type=int, default=1,
                        help="marsched's refresh_interval: recompute waiting requests' keys every k steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write every run's numbers here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: SCHEDULER:WAITING
    args = parser.parse_args()

    if args.one:
        scheduler, waiting = args.one.split(":")
        result = measure(args.model, scheduler, int(waiting), args.blocks, args.prompt, args.max_tokens,
                         args.max_num_seqs, args.warmup, args.steps, args.refresh_interval)
        print("RESULT " + json.dumps(result), flush=True)
        return

    model = args.model
    built = None
    if model is None:
        from marsched.bench.model import ModelShape, build_model

        built = Path(tempfile.mkdtemp(prefix="overhead-model-"))
        model = str(built / "tiny")
        build_model(model, ModelShape(**TINY, dtype="float32"))
    try:
        runs = _run_all(args, model)
    finally:
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
    _report(args, runs)


def _run_all(args: argparse.Namespace, model: str) -> list[dict]:
    sizes = [int(s) for s in args.sizes.split(",")]
    schedulers = ["stock", *[p.strip() for p in args.policies.split(",") if p.strip()]]
    runs = []
    for repeat in range(args.repeats):
        for waiting in sizes:
            for scheduler in schedulers:
                command = [sys.executable, __file__, "--one", f"{scheduler}:{waiting}", "--model", model,
                           "--blocks", str(args.blocks), "--prompt", str(args.prompt),
                           "--max-tokens", str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs),
                           "--warmup", str(args.warmup), "--refresh-interval", str(args.refresh_interval),
                           "--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    sys.exit(f"{scheduler} with {waiting} waiting failed:\n{done.stderr[-3000:]}")
                result = json.loads(lines[-1][len("RESULT "):]) | {"repeat": repeat}
                runs.append(result)
                print(f"  {scheduler:>9} {waiting:>6} waiting: schedule() median {result['schedule_median_ms']:.3f} ms, "
                      f"update {result['update_median_ms']:.3f} ms, step {result['step_median_ms']:.2f} ms "
                      f"({result['running']} running, {result['waiting_after']} waiting)", flush=True)
    return runs


def _report(args: argparse.Namespace, runs: list[dict]) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    schedulers = ["stock", *[p.strip() for p in args.policies.split(",") if p.strip()]]
    print(f"\nmedian per step over {args.steps} steps (ms); {args.repeats} repeat(s); tiny model, "
          f"{args.max_num_seqs} running, {args.blocks} blocks of 32 tokens; refresh_interval {args.refresh_interval}")
    print(f"{'waiting':>8} {'scheduler':>10} {'schedule()':>11} {'+ vs stock':>10} {'update':>8} {'+ vs stock':>10} "
          f"{'step':>8}")
    for waiting in sizes:
        rows = {s: [r for r in runs if r["waiting"] == waiting and r["scheduler"] == s] for s in schedulers}
        med = {s: {k: statistics.median(r[k] for r in rows[s]) for k in
                   ("schedule_median_ms", "update_median_ms", "step_median_ms")} for s in schedulers}
        for s in schedulers:
            extra = "" if s == "stock" else f"{med[s]['schedule_median_ms'] - med['stock']['schedule_median_ms']:+10.3f}"
            extra_u = "" if s == "stock" else f"{med[s]['update_median_ms'] - med['stock']['update_median_ms']:+10.3f}"
            print(f"{waiting:>8} {s:>10} {med[s]['schedule_median_ms']:>11.3f} {extra:>10} "
                  f"{med[s]['update_median_ms']:>8.3f} {extra_u:>10} {med[s]['step_median_ms']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")
        print(f"runs: {args.json}")


if __name__ == "__main__":
    main()
