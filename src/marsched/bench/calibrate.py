"""`marsched calibrate`: measure a real vLLM engine and fit a simulator profile from it.

The engine is built as `marsched bench` builds it (vLLM's CPU build, `enforce_eager`, bf16 or
the model's dtype, block size 128, prefix caching off, one worker beside the scheduler,
`HostSwapConnector` loaded), with vLLM's own scheduler timing every step (`bench.steps`'
`StepTimedScheduler`: start of `schedule()` to end of `update_from_output()`, logged by the
engine-core process). The measurements, each a grid point run as its own `LLM.generate` call
and identified in the step log by its time window (`time.monotonic()` is one clock for every
process):

- **prefill**: one request of N prompt tokens, one output token, `repeats` times per N; the
  sample is the median time of the steps that computed the N tokens;
- **decode**: B requests of L prompt tokens each, `decode_steps` output tokens; the sample is
  the median time of the steps that decoded all B together (no prefill in the step);
- **swap**: the Swap connector's own copy path (`kv_copy.KvMover`, out and back)
  on KV tensors of the engine's layout, dtype and block size, for several block counts, run in
  this process after the engine has stopped (the connector copies inside the worker in the same
  way); the sample is the median of `swap_repeats` copies;
- **KV capacity**: the engine's block count (vLLM's null block excluded) and block size.

Then `fit.fit_iteration_time` fits `t = c + a·new_tokens + b·context_tokens + d·sequences` to the
prefill and decode medians (relative least squares), with `e·attention_pairs` beside them when the
samples determine it (a prefill of N tokens makes N(N+1)/2 pairs, a decode step one per context
token read: two or more prefill sizes separate `e`; the profile says whether it was fitted),
`fit.fit_line` the swap times per block each
way, and `calibrated_profile` writes a profile JSON (`sim/profile.py` format) whose constants
each say where they come from and how well the fit holds.

This module imports vLLM only inside `measure`; the plan, the fits and the profile are pure.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from marsched.bench.fit import IterationFit, LineFit, StepSample, fit_iteration_time, fit_line
from marsched.bench.engine_config import (
    BLOCK_TOKENS, engine_kwargs, plan_engine, restore_environment, set_engine_environment,
)
from marsched.bench.model import ModelInfo, read_model
from marsched.bench.records import read_jsonl
from marsched.bench.stream import prompt_token_ids
from marsched.policy.cost_model import attention_pairs

Echo = Callable[[str], None]
_GB = 1e9


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What to measure. The default takes a few minutes on 2 cores with the default model."""

    prefill_tokens: tuple[int, ...] = (32, 128, 256, 512, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_contexts: tuple[int, ...] = (128, 512, 2048)
    decode_steps: int = 10  # steps with the whole batch decoding, per decode point
    repeats: int = 5  # prefill requests per size
    swap_blocks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    swap_repeats: int = 15
    kv_cache_gb: float | None = None  # None: VLLM_CPU_KVCACHE_SPACE if set, else 1 GiB (as bench)
    host_swap_gb: float | None = None  # host memory for swapped KV in the profile; None: the plugin's default
    dtype: str = "auto"
    seed: int = 0

    def check(self) -> None:
        """ValueError naming the option for a plan that cannot run."""
        for flag, values in (("--prefill-tokens", self.prefill_tokens), ("--decode-batches", self.decode_batches),
                             ("--decode-contexts", self.decode_contexts), ("--swap-blocks", self.swap_blocks)):
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{flag}: give one or more whole numbers >= 1, got {list(values)}")
        for flag, value, least in (("--decode-steps", self.decode_steps, 3), ("--repeats", self.repeats, 1),
                                   ("--swap-repeats", self.swap_repeats, 1)):
            if value < least:
                raise ValueError(f"{flag} {value}: give at least {least}")
        if len(set(self.prefill_tokens)) < 2:
            raise ValueError("--prefill-tokens: give at least two sizes (they separate a from d)")
        if len(set(self.decode_contexts)) < 2 and len(set(self.decode_batches)) < 2:
            raise ValueError("--decode-batches/--decode-contexts: give at least two of one of them")
        if len(set(self.swap_blocks)) < 2:
            raise ValueError("--swap-blocks: give at least two block counts")
        if self.kv_cache_gb is not None and not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
            raise ValueError(f"--kv-cache-gb {self.kv_cache_gb:g}: give a finite number of GiB > 0")
        if self.host_swap_gb is not None and not (math.isfinite(self.host_swap_gb) and self.host_swap_gb >= 0):
            raise ValueError(f"--host-swap-gb {self.host_swap_gb:g}: give a finite number of GB >= 0")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype {self.dtype}: valid: auto, bfloat16, float32")

    def check_against(self, max_model_len: int, max_tokens: int) -> None:
        """ValueError when a point does not fit the engine (one request's length, the KV cache)."""
        longest = max(max(self.prefill_tokens) + 1, max(self.decode_contexts) + self.decode_steps + _prefill_steps(self))
        if longest > max_model_len:
            raise ValueError(f"a point needs {longest} tokens of context but the engine's max model length is "
                             f"{max_model_len}; lower --prefill-tokens/--decode-contexts or raise --kv-cache-gb")
        widest = (max(self.decode_batches) * _blocks(max(self.decode_contexts) + self.decode_steps + _prefill_steps(self))
                  * BLOCK_TOKENS)
        if widest > max_tokens:
            raise ValueError(f"the largest decode point (batch {max(self.decode_batches)} × context "
                             f"{max(self.decode_contexts)}) needs {widest} tokens of KV cache but the engine holds "
                             f"{max_tokens}; raise --kv-cache-gb or lower --decode-batches/--decode-contexts")


FAST = CalibrationPlan(prefill_tokens=(16, 64, 256), decode_batches=(1, 4), decode_contexts=(32, 256), decode_steps=4,
                       repeats=2, swap_blocks=(1, 4, 8), swap_repeats=3)


def _prefill_steps(plan: CalibrationPlan, budget: int = 2048) -> int:
    """Steps the largest decode point spends prefilling (its first requests decode meanwhile)."""
    return -(-max(plan.decode_batches) * max(plan.decode_contexts) // budget)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


# --- measurements -------------------------------------------------------------------------------


@dataclass(slots=True)
class Measurements:
    """What `measure` saw: the grid's medians, the steps not in them, swap times, the engine's capacity."""

    model: ModelInfo
    prefill: list[StepSample] = field(default_factory=list)
    decode: list[StepSample] = field(default_factory=list)
    swap_out: list[tuple[int, float]] = field(default_factory=list)  # (blocks, median seconds)
    swap_in: list[tuple[int, float]] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)  # blocks, block_tokens, budget, max_model_len, ...
    unused_steps: list[dict[str, Any]] = field(default_factory=list)  # steps of the points not in a sample
    seconds: float = 0.0
    when: str = ""
    load_average: list[float] = field(default_factory=list)  # the machine's 1-minute load at start and end

    @property
    def samples(self) -> list[StepSample]:
        return self.prefill + self.decode


def samples_from_steps(steps: list[dict[str, Any]], windows: list[tuple[str, int, int, float, float]]
                       ) -> tuple[list[StepSample], list[StepSample], list[dict[str, Any]]]:
    """Prefill and decode samples from the step log and each point's window
    `(kind, tokens or context, batch, start, end)`; returns (prefill, decode, the other busy steps)."""
    prefill: dict[int, list[dict]] = {}
    decode: list[StepSample] = []
    used: set[int] = set()
    for kind, size, batch, start, end in windows:
        inside = [s for s in steps if start <= s["t"] <= end and s["tokens"] > 0]
        if kind == "prefill":
            chosen = [s for s in inside if s["tokens"] == size and s["seqs"] == 1]
            prefill.setdefault(size, []).extend(chosen)
        else:
            # All B decoding together, nothing prefilling (the point's first and last steps are not).
            chosen = [s for s in inside if s["seqs"] == batch and s["tokens"] == batch and s["prefill_seqs"] == 0]
            if chosen:
                context = round(statistics.median(s["ctx"] for s in chosen))
                # A decode token's attention pairs are its context read (`attention_pairs(1, k) = k + 1`).
                decode.append(StepSample(batch, context, batch, statistics.median(s["step_s"] for s in chosen),
                                         len(chosen), attention_pairs=context))
        used.update(id(s) for s in chosen)
    prefill_samples = [StepSample(size, size, 1, statistics.median(s["step_s"] for s in chosen), len(chosen),
                                  attention_pairs=attention_pairs(size, 0))
                       for size, chosen in sorted(prefill.items()) if chosen]
    rest = [s for s in steps if s["tokens"] > 0 and id(s) not in used
            and any(start <= s["t"] <= end for _, _, _, start, end in windows)]
    return prefill_samples, decode, rest


def time_swap(model: ModelInfo, dtype: str, block_counts: tuple[int, ...], repeats: int,
              blocks_in_cache: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Median seconds to copy n blocks of every layer out to host memory and back in, through the
    Swap connector's own copy path (`kv_copy.KvMover`) on the device the engine uses (CUDA when
    present: pinned host memory, side streams, timed by CUDA events; else CPU: synchronous copies,
    timed by the wall clock), on tensors of vLLM's per-layer KV view
    (`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, block dimension 0)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    # One thread: the copy is memory-bound, and on a shared machine a 2-thread parallel region
    # waits for a descheduled thread (measured: 90 ms for any copy of 4+ blocks at load 6 on 2 cores).
    torch.set_num_threads(1)
    try:
        return _time_swap(torch, model, dtype, block_counts, repeats, blocks_in_cache, device)
    finally:
        torch.set_num_threads(threads)


def _time_swap(torch: Any, model: ModelInfo, dtype: str, block_counts: tuple[int, ...], repeats: int,
               blocks_in_cache: int, device: str = "cpu") -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    from marsched.vllm.kv_copy import KvMover
    from marsched.vllm.kv_copy_layout import BlockLayout

    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    cache_blocks = min(blocks_in_cache, max(block_counts) * 4 + 1)  # copies read scattered blocks of a large pool
    shape = (cache_blocks, model.kv_heads, BLOCK_TOKENS, 2 * model.head_dim)
    caches = {f"layer{i}": torch.randn(shape, dtype=torch.float32).to(torch_dtype).to(device)
              for i in range(model.layers)}
    mover = KvMover(caches, dict.fromkeys(caches, BlockLayout(0)))
    out, back = [], []
    for n in block_counts:
        ids = list(range(1, 4 * n + 1, 4))[:n]  # spread blocks, as a real request's are
        out_times, in_times = [], []
        for _ in range(repeats + 1):  # the first copy of a size warms the allocator: dropped
            sent = mover.copy_out("calibrate", ids)
            mover.wait(sent)
            restored = mover.copy_in("calibrate", ids)
            mover.wait(restored)
            out_times.append(sent.seconds())
            in_times.append(restored.seconds())
        out.append((n, statistics.median(out_times[1:])))
        back.append((n, statistics.median(in_times[1:])))
    mover.shutdown()
    return out, back


def measure(model_dir: str, plan: CalibrationPlan, echo: Echo = print) -> Measurements:
    """Run the plan on a fresh engine (started and shut down here) and time the swap copies."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from marsched.bench.steps import ENV_VAR, FLUSH_S, STEP_TIMED_VLLM
    from marsched.vllm.runtime import swap_connector_config

    plan.check()
    started = time.monotonic()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    model = read_model(model_dir)
    sizing = plan_engine(model, dtype=plan.dtype, kv_cache_gb=plan.kv_cache_gb)  # as bench sizes its engine
    dtype = sizing.dtype
    info = sizing.engine_model(model)
    workdir = Path(tempfile.mkdtemp(prefix="marsched-calibrate-"))
    step_log = workdir / "steps.jsonl"
    saved_env = set_engine_environment(sizing, {ENV_VAR: str(step_log)})
    kwargs: dict[str, Any] = {**engine_kwargs(sizing, plan.seed), "enable_prefix_caching": False,
                              "distributed_executor_backend": "uni"}
    # The largest prefill is one step: the budget must hold it (vLLM's default may be smaller).
    kwargs["max_num_batched_tokens"] = max(max(plan.prefill_tokens), 2048)
    kwargs["max_num_seqs"] = max(max(plan.decode_batches), 256)
    measurements = Measurements(info, when=when, load_average=[round(os.getloadavg()[0], 2)])
    windows: list[tuple[str, int, int, float, float]] = []
    llm = None
    try:
        echo(f"starting vLLM on {model_dir} ({dtype}, block size {BLOCK_TOKENS})")
        begin = time.monotonic()
        llm = LLM(model=str(model_dir), scheduler_cls=STEP_TIMED_VLLM, kv_transfer_config=swap_connector_config(),
                  **kwargs)
        config = llm.llm_engine.vllm_config
        blocks = int(config.cache_config.num_gpu_blocks or 0) - 1  # vLLM's null block is never free
        measurements.engine = {
            "blocks": blocks, "block_tokens": int(config.cache_config.block_size),
            "tokens": blocks * int(config.cache_config.block_size),
            "max_model_len": int(config.model_config.max_model_len),
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
            "reserve_full_prompt": bool(config.scheduler_config.scheduler_reserve_full_isl),
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "kv_cache_gb": plan.kv_cache_gb, "start_s": round(time.monotonic() - begin, 1),
        }
        echo(f"engine up in {measurements.engine['start_s']:.0f} s: {blocks} KV blocks × "
             f"{measurements.engine['block_tokens']} tokens, max model length "
             f"{measurements.engine['max_model_len']}, token budget {measurements.engine['max_num_batched_tokens']}")
        plan.check_against(measurements.engine["max_model_len"], measurements.engine["tokens"])
        vocab = model.vocab

        def run(key: str, prompts: list[int], count: int, outputs: int) -> tuple[float, float]:
            params = SamplingParams(max_tokens=outputs, ignore_eos=True, detokenize=False)
            requests = [TokensPrompt(prompt_token_ids=prompt_token_ids(f"{key}/{i}", prompts[i], vocab))
                        for i in range(count)]
            start = time.monotonic()
            llm.generate(requests, params, use_tqdm=False)
            return start, time.monotonic()

        run("warmup", [min(256, max(plan.prefill_tokens))], 1, 8)  # first passes of new shapes are slow
        # Repeats in rounds over the sizes, so that a burst of load on the shared machine spreads over
        # sizes instead of moving one size's median.
        points = [("prefill", n, 1) for _ in range(plan.repeats) for n in plan.prefill_tokens]
        points += [("decode", length, batch) for batch in plan.decode_batches for length in plan.decode_contexts]
        for index, (kind, size, batch) in enumerate(points):
            label = f"prefill {size} tokens" if kind == "prefill" else f"decode batch {batch} × context {size}"
            echo(f"[{index + 1}/{len(points)}] {label} ({time.monotonic() - started:.0f} s)")
            # A decode point's first requests decode while the others still prefill (one budget-sized
            # chunk per step): they must last past the prefill to give `decode_steps` steps of all B.
            budget = measurements.engine["max_num_batched_tokens"]
            outputs = 1 if kind == "prefill" else plan.decode_steps + -(-batch * size // budget)
            start, end = run(f"{kind}/{size}/{batch}/{index}", [size] * batch, batch, outputs)
            windows.append((kind, size, batch, start, end))
        # The engine flushes its step log at most every FLUSH_S and at a clean shutdown, which vLLM
        # may cut short: one more step after FLUSH_S writes every line of the last point.
        time.sleep(FLUSH_S + 0.1)
        run("flush", [1], 1, 1)
    finally:
        if llm is not None:
            echo("shutting vLLM down")
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        restore_environment(saved_env)
    try:
        steps = read_jsonl(step_log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    measurements.prefill, measurements.decode, measurements.unused_steps = samples_from_steps(steps, windows)
    echo(f"swap copies: {list(plan.swap_blocks)} blocks, {plan.swap_repeats} repeats each")
    measurements.swap_out, measurements.swap_in = time_swap(info, dtype, plan.swap_blocks, plan.swap_repeats,
                                                            measurements.engine["blocks"])
    measurements.seconds = time.monotonic() - started
    measurements.load_average.append(round(os.getloadavg()[0], 2))
    return measurements


# --- the profile ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Calibration:
    iteration: IterationFit
    swap_out: LineFit  # seconds over blocks
    swap_in: LineFit


def fit_measurements(m: Measurements) -> Calibration:
    try:
        iteration = fit_iteration_time(m.samples)
    except ValueError as error:
        raise ValueError(f"iteration-time fit: {error} ({len(m.prefill)} prefill and {len(m.decode)} decode "
                         f"samples measured)") from None
    # Through the origin: the cost model's swap time is proportional to the tokens moved.
    out = fit_line([n for n, _ in m.swap_out], [t for _, t in m.swap_out], through_origin=True)
    back = fit_line([n for n, _ in m.swap_in], [t for _, t in m.swap_in], through_origin=True)
    return Calibration(iteration, out, back)


def _quality(fit: Any) -> str:
    q = fit.quality
    return f"R² {q.r2:.4f}, relative RMS {q.relative_rms:.1%}, worst {q.max_relative_error:.1%}, {q.samples} samples"


def calibrated_profile(m: Measurements, cal: Calibration, name: str, host_swap_tokens: int) -> dict[str, Any]:
    """The profile JSON (sim/profile.py's format, capacity stated in blocks) for these measurements."""
    it, info, engine = cal.iteration, m.model, m.engine
    block_tokens = engine["block_tokens"]
    block_bytes = info.kv_bytes_per_token * block_tokens
    per_block = (cal.swap_out.slope + cal.swap_in.slope) / 2
    link = block_bytes / per_block / _GB if per_block > 0 else math.inf
    load = f", load average {'→'.join(map(str, m.load_average))} on {os.cpu_count()} CPUs" if m.load_average else ""
    where = f"measured by marsched calibrate on vLLM {_vllm_version()} (CPU) with model {info.path}, {m.when}{load}"
    grid = (f"{len(m.prefill)} prefill sizes {[s.new_tokens for s in m.prefill]} and {len(m.decode)} decode points "
            f"(batch × context) {[(s.sequences, round(s.context_tokens / s.sequences)) for s in m.decode]}, each the "
            f"median of its steps ({sum(s.repeats for s in m.samples)} steps)")
    fit_note = (f"least squares, relative errors, constants >= 0, of t = c + a·new_tokens + b·context_tokens + "
                f"d·sequences{' + e·attention_pairs' if it.attention == 'fitted' else ''} over {grid}; {_quality(it)}")
    return {
        "name": name,
        "description": f"{info.name} ({info.layers} layers, {info.kv_heads} KV heads × {info.head_dim}, {info.dtype}) "
                       f"on vLLM's CPU build, measured by marsched calibrate",
        "model": {
            "name": info.name,
            "parameters": _parameters(info.path),
            "layers": info.layers,
            "kv_hidden_size": info.kv_heads * info.head_dim,
            "dtype_bytes": _dtype_bytes(info.dtype),
            "source": f"{info.path}/config.json (kv_hidden_size = KV heads × head size)",
        },
        "device_blocks": engine["blocks"],
        "device_blocks_source": f"{where}: vLLM's KV cache blocks (null block excluded), "
                                f"{'--kv-cache-gb ' + format(engine['kv_cache_gb'], 'g') if engine['kv_cache_gb'] else 'VLLM_CPU_KVCACHE_SPACE'}",
        "host_blocks": host_swap_tokens // block_tokens,
        "host_blocks_source": f"the vLLM plugin's host swap budget: {host_swap_tokens} tokens "
                              f"(MarsConfig.host_swap_tokens or --host-swap-gb)",
        "block_tokens": block_tokens,
        "block_tokens_source": f"{where}: vLLM's cache block size",
        "token_budget": engine["max_num_batched_tokens"],
        "token_budget_source": f"{where}: the engine's max_num_batched_tokens",
        "max_num_seqs": engine["max_num_seqs"],
        "max_num_seqs_source": f"{where}: the engine's max_num_seqs",
        "admits_whole_prompt": engine.get("reserve_full_prompt", False),
        "admits_whole_prompt_source": f"{where}: the engine's scheduler_reserve_full_isl (a waiting request "
                                      "is admitted when its whole prompt fits)",
        "iteration_ms_fixed": round(it.c * 1e3, 6),
        "iteration_ms_per_token": round(it.a * 1e3, 7),
        "iteration_us_per_context_token": round(it.b * 1e6, 7),
        "iteration_ms_per_sequence": round(it.d * 1e3, 7),
        "iteration_ns_per_attention_pair": round(it.e * 1e9, 7),
        "iteration_source": f"{where}: step time from the start of schedule() to the end of update_from_output() "
                            f"(vLLM's scheduler); {fit_note}",
        "iteration_ms_fixed_source": f"{where}; {fit_note}",
        "iteration_ms_per_token_source": f"{where}; {fit_note}",
        "iteration_us_per_context_token_source": f"{where}; {fit_note}",
        "iteration_ms_per_sequence_source": f"{where}; {fit_note}",
        "iteration_ns_per_attention_pair_source": (f"{where}; {fit_note}" if it.attention == "fitted"
                                                   else f"e = 0, {it.attention}"),
        "link_gb_per_s": round(link, 4),
        "link_source": f"{where}: {block_bytes} bytes per block / the mean of the per-block swap-out and swap-in "
                       f"times (HostSwapConnector's copy functions on the CPU KV layout)",
        "swap_out_ms_per_block": round(cal.swap_out.slope * 1e3, 6),
        "swap_out_source": f"{where}: median of repeated copies of {[n for n, _ in m.swap_out]} blocks; fit "
                           f"through the origin, {_quality(cal.swap_out)}",
        "swap_in_ms_per_block": round(cal.swap_in.slope * 1e3, 6),
        "swap_in_source": f"{where}: median of repeated copies of {[n for n, _ in m.swap_in]} blocks; fit "
                          f"through the origin, {_quality(cal.swap_in)}",
        "measurements": {
            "engine": engine,
            "seconds": round(m.seconds, 1),
            "load_average": m.load_average,
            "cpus": os.cpu_count(),
            "prefill": [asdict(s) for s in m.prefill],
            "decode": [asdict(s) for s in m.decode],
            "swap_out_s": m.swap_out,
            "swap_in_s": m.swap_in,
            "fit": {"r2": it.quality.r2, "relative_rms": it.quality.relative_rms,
                    "max_relative_error": it.quality.max_relative_error, "samples": it.quality.samples},
            "held_out": held_out_error(it, m.unused_steps),
        },
    }


def held_out_error(fit: IterationFit, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """How the fit predicts the steps not used in it (the grid's prefill of decode points: several
    sequences and chunks in one step): count, median and 90th-percentile relative error."""
    # Step logs written before the attention pairs were logged carry none.
    errors = sorted(abs(fit.predict(s["tokens"], s["ctx"], s["seqs"], s.get("pairs", 0)) - s["step_s"]) / s["step_s"]
                    for s in steps if s["step_s"] > 0)
    if not errors:
        return {"steps": 0}
    return {"steps": len(errors), "median_relative_error": round(statistics.median(errors), 4),
            "p90_relative_error": round(errors[int(0.9 * (len(errors) - 1))], 4)}


def _parameters(path: str) -> float:
    try:
        return float(json.loads((Path(path) / "marsched_model.json").read_text())["parameters"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0  # not known; the profile states capacity in blocks, so nothing derives from it


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "?"
