"""The `marsched model`, `marsched bench` and `marsched calibrate` commands (registered in `marsched.cli`).

Kept apart from `cli.py` so that the simulator's commands do not change with them; none
imports torch, transformers or vLLM until it runs.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from marsched.bench.model import DTYPES, ModelShape, check_out_dir, read_model
from marsched.bench.report import plot_latency, write_json
from marsched.cli_checks import (
    checked, comma_names, existing_folder, fail, load_trace_or_fail, need_modules, positive_numbers, whole_numbers,
)
from marsched.cli_output import console, errors, progress, strategy_cells
from marsched.workload.loader import TRACE_NAMES

if TYPE_CHECKING:
    from marsched.bench.calibrate import Calibration, Measurements

_SMALL = ModelShape()


# --- marsched model --------------------------------------------------------------------------


def model(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the model to (new or empty).")],
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = _SMALL.layers,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = _SMALL.hidden,
    heads: Annotated[int, typer.Option(help="Attention (query) heads; head size = hidden / heads.")] = _SMALL.heads,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = _SMALL.kv_heads,
    intermediate: Annotated[int, typer.Option(help="MLP intermediate size.")] = _SMALL.intermediate,
    vocab: Annotated[int, typer.Option(help="Vocabulary size (model and tokenizer).")] = _SMALL.vocab,
    max_position: Annotated[int, typer.Option(help="Longest context (max_position_embeddings).")] = _SMALL.max_position,
    seed: Annotated[int, typer.Option(help="Seed of the weights and of the tokenizer's corpus.")] = _SMALL.seed,
    dtype: Annotated[str, typer.Option(help=f"Weights' dtype: {', '.join(DTYPES)}.")] = _SMALL.dtype,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty --out.")] = False,
) -> None:
    """Build a random-weight Llama with a locally trained tokenizer; nothing is downloaded.

    The defaults are the "small" shape measured on this kind of 2-core CPU (docs: cpu-vllm-measurements): 4 layers, hidden 512, 8/2 heads, 48M parameters, bf16. Its forward pass is mostly real compute (about 2.6 ms per decode step at batch 1, 26 ms for a 512-token prefill, 0.14 µs per context token read in decode), so prefill, batch size and context length all show in iteration time; smaller shapes are mostly framework overhead. bf16 runs faster than float32 on vLLM's CPU build (AVX-512 BF16) and halves the KV cache per token.
    """
    shape = ModelShape(layers, hidden, heads, kv_heads, intermediate, vocab, max_position, seed, dtype)
    checked(shape.check)
    checked(lambda: check_out_dir(out, force))  # a ModelDirError is a ValueError
    need_modules("model")
    from marsched.bench.model import build_model

    with errors.status(f"building {shape.parameters / 1e6:.1f}M-parameter model in {out}"):
        info = build_model(out, shape, force=force)
    console.print(f"model: {out} ({info['parameters'] / 1e6:.1f}M parameters, {info['layers']} layers, hidden "
                  f"{info['hidden']}, {info['heads']}/{info['kv_heads']} heads, {info['dtype']}, "
                  f"{info['kv_bytes_per_token']} bytes of KV cache per token)", highlight=False)


# --- marsched bench --------------------------------------------------------------------------


def _table(records: list[dict]) -> Table:
    table = Table(title="vLLM: end-to-end latency (s), time to first token (s), step time (ms)", header_style="bold")
    columns = ("qps", "policy", "e2e mean", "e2e p50", "e2e p99", "ttft mean", "ttft p99", "× isolated",
               "preempt", "strategies", "step p50", "step p99", "sched p50", "finished")
    for column in columns:
        table.add_column(column, justify="left" if column in ("policy", "strategies") else "right")
    for r in sorted(records, key=lambda r: r["qps"]):  # stable: policies stay in the order given
        it = r["iteration"]
        finished = f"{r['num_finished']}/{r['num_requests']}" + (" partial" if r.get("partial") else "")
        if not r["num_finished"]:
            table.add_row(f"{r['qps']:g}", r["policy"], *["-"] * 8, f"{it['p50_s'] * 1e3:.1f}",
                          f"{it['p99_s'] * 1e3:.1f}", f"{it['schedule_p50_s'] * 1e3:.2f}", finished)
            continue
        table.add_row(
            f"{r['qps']:g}", r["policy"], f"{r['e2e_mean_s']:.2f}", f"{r['e2e_p50_s']:.2f}", f"{r['e2e_p99_s']:.2f}",
            f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['e2e_mean_s'] / r['isolated_e2e_mean_s']:.2f}",
            str(r["preemptions"]), strategy_cells(r["strategy_counts"]), f"{it['p50_s'] * 1e3:.1f}", f"{it['p99_s'] * 1e3:.1f}",
            f"{it['schedule_p50_s'] * 1e3:.2f}", finished)
    return table


def bench(
    model_dir: Annotated[Path, typer.Option("--model", help="Model directory (`marsched model --out DIR`).")],
    trace: Annotated[str, typer.Option(
        help=f"Trace file (.json INFERCEPT/MARS, .jsonl ours) or a bundled trace: {', '.join(TRACE_NAMES)}.")] = "single",
    policies: Annotated[str, typer.Option(help="Comma-separated policy names.")] = "vllm,infercept,mars",
    qps: Annotated[str, typer.Option(help="Comma-separated arrival rates (requests per second).")] = "1",
    duration: Annotated[float, typer.Option(help="Seconds of Poisson arrivals; each run then drains.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Seed of the arrivals (and of noisy predictions).")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the metrics records (a JSON list) here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of mean and p99 latency against QPS.")] = None,
    api_time_scale: Annotated[float, typer.Option(
        help="Multiply every API call's duration by this (calls are timed sleeps).")] = 1.0,
    token_scale: Annotated[float, typer.Option(
        help="Multiply every token count (prompt, outputs, API returns) by this, rounded, at least 1 per "
             "prompt and segment; a request still longer than the engine's max model length is shrunk "
             "further, as a whole, until it fits.")] = 1.0,
    kv_cache_gb: Annotated[float | None, typer.Option(
        help="KV cache size in GiB (may be fractional: it sets vLLM's block count); default: "
             "VLLM_CPU_KVCACHE_SPACE if set, else 1 GiB.")] = None,
    max_requests: Annotated[int | None, typer.Option(help="Keep only the first N arrivals of each stream.")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        help="Cap vLLM's max model length (default: the model's, and what the KV cache holds).")] = None,
    predictor: Annotated[str, typer.Option(
        help="Output-length predictor: oracle, noisy:SIGMA, type-mean, learned or learned:DIR.")] = "oracle",
    api_estimator: Annotated[str, typer.Option(help="API-duration estimate: type-mean or oracle.")] = "type-mean",
    dtype: Annotated[str, typer.Option(help="auto (the model's), bfloat16 or float32.")] = "auto",
    strict: Annotated[bool, typer.Option("--strict", help="Reject trace values otherwise read leniently.")] = False,
    profile: Annotated[str | None, typer.Option(
        help="The plugin's cost model from a profile (a bundled name or a .json path, e.g. from `marsched "
             "calibrate`); default: the placeholder CostSettings.")] = None,
    starvation: Annotated[str, typer.Option(
        help="Starvation prevention variant (fcfs-wait[:K], age, published, iterations, off), or 'default' "
             "(fcfs-wait for mars, off for the others).")] = "default",
) -> None:
    """Replay a trace on real vLLM (MarsScheduler, host swap), one engine per policy and load.

    Poisson arrivals, prompt ids generated from each request's id, each segment's length forced, API calls as timed sleeps. Writes the same records as `compare` with engine "vllm", plus the measured step times, the model and the KV capacity. Ctrl-C stops the run, writes what was measured (marked "partial") and shuts the engine down.
    """
    from marsched.bench.real import run_bench
    from marsched.bench.spec import BenchSpec

    rates = positive_numbers(qps, "--qps", "0.5,1,2")
    spec = BenchSpec(str(model_dir), trace, tuple(comma_names(policies)), tuple(rates), duration, seed,
                     api_time_scale, token_scale, kv_cache_gb, max_requests, max_model_len, predictor, api_estimator,
                     strict, dtype, profile, starvation)
    checked(spec.check)
    checked(lambda: spec.engine_plan(read_model(model_dir)))  # a KV cache too small for one block fails here
    load_trace_or_fail(trace, strict)
    for flag, path in (("--json", json_path), ("--plot", plot)):
        if path is not None:
            existing_folder(flag, path)
    need_modules("bench")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's INFO and WARNING lines would bury the progress bar

    records: list[dict] = []

    def save(record: dict) -> None:
        records.append(record)
        if json_path:
            write_json(records, json_path)

    with progress() as bar:
        task = bar.add_task("starting", total=None)
        try:
            result = run_bench(spec, on_record=save,
                               on_progress=lambda what, done, total: bar.update(task, description=what,
                                                                                 completed=done, total=total))
        except Exception as error:  # noqa: BLE001 - vLLM failing to start or dying: one line, not a traceback
            bar.stop()
            kept = f"; the {len(records)} finished run(s) are in {json_path}" if json_path and records else ""
            fail(f"vLLM failed ({type(error).__name__}: {error}); its log is above{kept}")
    records = result.records
    if json_path:
        write_json(records, json_path)
    if not records:
        if result.partial and not result.error:
            errors.print("interrupted before any run started; nothing measured", highlight=False)
            raise typer.Exit(130)
        fail(result.error or "nothing measured")
    console.print(_table(records))
    first = records[0]
    kv = first["kv_cache"]
    console.print(f"model {first['model']['path']} ({first['model']['dtype']}); KV cache {kv['blocks']} blocks × "
                  f"{kv['block_tokens']} = {kv['tokens']} tokens; max model length {kv['max_model_len']}; "
                  f"API time × {first['api_time_scale']:g}; tokens × {first['token_scale']:g}", highlight=False)
    if json_path:
        console.print(f"metrics: {json_path}" + (" (partial: interrupted)" if result.partial else ""))
    if plot:
        complete = [r for r in records if r["num_finished"]]
        if complete:
            plot_latency(complete, plot)
            console.print(f"plot: {plot}")
    if result.error:
        fail(result.error)
    if result.partial:
        raise typer.Exit(130)


# --- marsched calibrate ----------------------------------------------------------------------


def calibrate(
    model_dir: Annotated[Path, typer.Option("--model", help="Model directory (`marsched model --out DIR`).")],
    out: Annotated[Path, typer.Option("--out", help="Write the fitted profile (JSON) here.")],
    name: Annotated[str | None, typer.Option(help="The profile's name (default: the --out file's stem).")] = None,
    kv_cache_gb: Annotated[float | None, typer.Option(
        help="KV cache size in GiB (fractional allowed, as in bench); default: VLLM_CPU_KVCACHE_SPACE if set, "
             "else 1 GiB. The profile's device capacity is what the engine reports.")] = None,
    host_swap_gb: Annotated[float | None, typer.Option(
        help="Host memory for swapped KV in the profile, in GB (default: the vLLM plugin's host_swap_tokens).")] = None,
    prefill_tokens: Annotated[str | None, typer.Option(help="Prefill sizes to time (comma-separated tokens).")] = None,
    decode_batches: Annotated[str | None, typer.Option(help="Decode batch sizes (comma-separated).")] = None,
    decode_contexts: Annotated[str | None, typer.Option(help="Decode context lengths (comma-separated tokens).")] = None,
    decode_steps: Annotated[int | None, typer.Option(help="Output tokens per decode point.")] = None,
    repeats: Annotated[int | None, typer.Option(help="Requests per prefill size (the median is kept).")] = None,
    swap_blocks: Annotated[str | None, typer.Option(help="Block counts of the swap copies (comma-separated).")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="A few points only (tests, a first look): "
                                                      "prefill 16,64,256; decode 1,4 × 32,256.")] = False,
    dtype: Annotated[str, typer.Option(help="auto (the model's), bfloat16 or float32.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
) -> None:
    """Measure real vLLM and fit a simulator profile: t = c + a·new tokens + b·context tokens + d·sequences (+ e·attention pairs).

    Times vLLM's steps (the scheduler's step timer, as bench) for prefills of several sizes and decodes over a batch × context grid, medians of repeats; times the Swap connector's block copies each way; reads the engine's KV capacity. Writes a profile JSON for `simulate --profile` and the vLLM plugin (`--profile`), every constant with its source and fit error. A few minutes with the defaults.
    """
    from marsched.bench.calibrate import FAST, CalibrationPlan

    plan = FAST if fast else CalibrationPlan()
    overrides: dict = {"kv_cache_gb": kv_cache_gb, "host_swap_gb": host_swap_gb, "dtype": dtype}
    for key, text, flag in (("prefill_tokens", prefill_tokens, "--prefill-tokens"),
                            ("decode_batches", decode_batches, "--decode-batches"),
                            ("decode_contexts", decode_contexts, "--decode-contexts"),
                            ("swap_blocks", swap_blocks, "--swap-blocks")):
        if text is not None:
            overrides[key] = whole_numbers(text, flag)
    for key, value in (("decode_steps", decode_steps), ("repeats", repeats)):
        if value is not None:
            overrides[key] = value
    plan = replace(plan, **overrides)
    checked(plan.check)
    checked(lambda: read_model(model_dir))
    if out.exists() and not force:
        fail(f"--out {out}: exists; add --force to overwrite it")
    existing_folder("--out", out)
    need_modules("calibrate")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from marsched.bench.calibrate import calibrated_profile, fit_measurements, measure
    from marsched.vllm.config import MarsConfig

    def echo(line: str) -> None:
        errors.print(line, highlight=False)

    try:
        measured = measure(str(model_dir), plan, echo)
    except ValueError as error:
        fail(str(error))
    except Exception as error:  # noqa: BLE001 - vLLM failing: one line, its log is above
        fail(f"vLLM failed ({type(error).__name__}: {error}); its log is above")
    fitted = checked(lambda: fit_measurements(measured))
    host_tokens = (MarsConfig().host_swap_tokens if plan.host_swap_gb is None
                   else int(plan.host_swap_gb * 1e9 // measured.model.kv_bytes_per_token))
    profile = calibrated_profile(measured, fitted, name or out.stem, host_tokens)
    loadable_or_fail(profile, out)
    write_json(profile, out)
    console.print(_calibration_table(measured, fitted))
    it = fitted.iteration
    q = it.quality
    console.print(f"fit: t = {it.c * 1e3:.3f} ms + {it.a * 1e3:.5f} ms·new tokens + {it.b * 1e6:.5f} µs·context tokens "
                  f"+ {it.d * 1e3:.4f} ms·sequences + {it.e * 1e9:.5f} ns·attention pairs ({it.attention}); "
                  f"R² {q.r2:.4f}, relative RMS {q.relative_rms:.1%}, worst "
                  f"{q.max_relative_error:.1%} over {q.samples} samples", highlight=False)
    held = profile["measurements"]["held_out"]
    if held.get("steps"):
        console.print(f"held-out steps (prefill of the decode points, not fitted): {held['steps']}, median relative "
                      f"error {held['median_relative_error']:.1%}, p90 {held['p90_relative_error']:.1%}", highlight=False)
    console.print(f"swap per block: out {fitted.swap_out.slope * 1e3:.4f} ms, in {fitted.swap_in.slope * 1e3:.4f} ms "
                  f"(link {profile['link_gb_per_s']:g} GB/s); KV cache {profile['device_blocks']} blocks × "
                  f"{profile['block_tokens']} tokens; {measured.seconds:.0f} s", highlight=False)
    console.print(f"profile: {out}")


def loadable_or_fail(profile: dict, out: Path) -> None:
    """What calibrate writes must load as a profile; if it would not, fail saying why (nothing is
    written). A fit on noisy measurements can put a cost the profile needs at zero."""
    from marsched.sim.profile import profile_from_dict

    try:
        profile_from_dict(profile, str(out))
    except ValueError as error:
        fail(f"the fit does not make a usable profile ({error}): the measurements were too noisy to "
             f"separate the costs (other work on these cores?); run it again on a quiet machine, or "
             f"without --fast for more samples")


def _calibration_table(m: "Measurements", cal: "Calibration") -> Table:
    table = Table(title="measured step medians and the fit (ms)", header_style="bold")
    for column in ("kind", "new tokens", "sequences", "context", "steps", "measured", "fit", "error"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    it = cal.iteration
    for kind, samples in (("prefill", m.prefill), ("decode", m.decode)):
        for s in samples:
            predicted = it.predict(s.new_tokens, s.context_tokens, s.sequences, s.attention_pairs)
            table.add_row(kind, str(s.new_tokens), str(s.sequences), str(s.context_tokens), str(s.repeats),
                          f"{s.seconds * 1e3:.2f}", f"{predicted * 1e3:.2f}", f"{(predicted / s.seconds - 1):+.1%}")
    return table
