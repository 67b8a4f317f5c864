"""The `marsched regime` command (registered in `marsched.cli`): MARS against INFERCEPT over
load × KV capacity × API time, on the simulator, as a JSON file and heat maps."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from marsched.atomic import OutputPathError, check_output_path, write_atomically
from marsched.bench.runner import RunSpec, run_grid
from marsched.cli_checks import fail, positive_numbers
from marsched.predict import parse_api_estimator, parse_length_predictor
from marsched.predict.online import DEFAULT_API_ESTIMATOR, DEFAULT_PREDICTOR
from marsched.regime.table import POLICIES, Thresholds, distinct_values, regime_cells, text_table
from marsched.sim.memory import blocks_for
from marsched.sim.profile import load_profile, scale_kv_capacity
from marsched.workload.loader import TRACE_NAMES, load_trace


def _axis(text: str, flag: str, example: str) -> list[float]:
    values = positive_numbers(text, flag, example)
    try:
        return distinct_values(text, values, flag)
    except ValueError as error:
        fail(str(error))


def _write(flag: str, path: Path, write) -> None:
    try:
        write()
    except OSError as error:
        fail(f"{flag} {path}: writing failed: {error.strerror or error}")


def _check_kv_scales(trace: str, strict: bool, profile_name: str, kv_scales: list[float]) -> None:
    """Every request of the trace must fit in the smallest KV capacity, or that run would fail late."""
    try:
        profile = load_profile(profile_name)
    except ValueError as error:
        fail(f"--profile {profile_name}: {error}")
    try:
        templates = load_trace(trace, strict=strict)
    except ValueError as error:
        message = str(error)  # a trace file's errors start with its path already
        fail(f"--trace {message}" if message.startswith(f"{trace}:") else f"--trace {trace}: {message}")
    longest = max(blocks_for(r.final_context_tokens + 1, profile.block_tokens) for r in templates)
    for scale in kv_scales:
        blocks = scale_kv_capacity(profile, scale).device_blocks
        if blocks < longest:
            fail(f"--kv-scale {scale:g}: {blocks} KV blocks, but the longest request of trace {trace} needs "
                 f"{longest} (of {profile.device_blocks} at ×1); give scales ≥ {longest / profile.device_blocks:.3g}")


def regime(
    trace: Annotated[str, typer.Option(help=f"Trace: {', '.join(TRACE_NAMES)} or a trace file.")] = "single",
    qps: Annotated[str, typer.Option(help="Comma-separated arrival rates (x axis).")] = "4,8,12,16",
    kv_scale: Annotated[str, typer.Option(
        "--kv-scale", help="Comma-separated factors on the profile's device KV blocks (y axis).")] = "0.5,1,2",
    api_time_scale: Annotated[str, typer.Option(
        "--api-time-scale", help="Comma-separated factors on every API call's duration (one row each).")] = "0.5,1,2",
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write the cells and every run's record here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the heat maps (PNG) here.")] = None,
    profile: Annotated[str, typer.Option(help="Profile name or path to a profile .json.")] = "gptj-6b-a100",
    duration: Annotated[float, typer.Option(help="Seconds of Poisson arrivals per run; each run then drains.")] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed for arrivals (0 to 2^32-1); the same stream at every point.")] = 0,
    workers: Annotated[int, typer.Option(help="Parallel processes (0: one per core).")] = 0,
    predictor: Annotated[str, typer.Option(
        help="Output-length predictor: online (knowable: the default), or a bound: oracle, noisy:SIGMA, "
             "foreknowledge.")] = DEFAULT_PREDICTOR,
    api_estimator: Annotated[str, typer.Option(
        "--api-estimator", help="API-duration estimate: past-mean (knowable: the default), or a bound: type-mean, "
                                "oracle.")] = DEFAULT_API_ESTIMATOR,
    light_excess: Annotated[float, typer.Option(
        help="Light: every policy's mean within this fraction of the isolated floor.")] = Thresholds().light_excess,
    overload_wait: Annotated[float, typer.Option(
        help="Overloaded: INFERCEPT's longest queue wait over this fraction of --duration.")]
        = Thresholds().overload_wait_fraction,
    strict: Annotated[bool, typer.Option("--strict", help="Reject trace values read leniently otherwise.")] = False,
) -> None:
    """Where MARS wins: MARS over INFERCEPT mean and p99 end-to-end latency over load × KV capacity ×
    API time, each point marked light, saturated or overloaded (from its measurements)."""
    rates = _axis(qps, "--qps", "4,8,12")
    kv_scales = _axis(kv_scale, "--kv-scale", "0.5,1,2")
    api_scales = _axis(api_time_scale, "--api-time-scale", "0.5,1,2")
    if not duration > 0 or duration == float("inf"):
        fail(f"--duration {duration:g}: give a finite number of seconds > 0")
    if not 0 <= seed < 2**32:
        fail(f"--seed {seed}: give an integer from 0 to 2^32-1")
    for flag, value, parse in (("--predictor", predictor, lambda: parse_length_predictor(predictor, seed)),
                               ("--api-estimator", api_estimator, lambda: parse_api_estimator(api_estimator))):
        try:
            parse()
        except ValueError as error:
            fail(f"{flag} {value}: {error}")
    if workers < 0:
        fail(f"--workers {workers}: give 0 (one per core) or a number of processes >= 1")
    for flag, value in (("--light-excess", light_excess), ("--overload-wait", overload_wait)):
        if not 0 < value < float("inf"):
            fail(f"{flag} {value:g}: give a fraction > 0")
    if json_path is None and plot is None:
        fail("give --json, --plot or both: a regime map is long to compute and has nowhere to go")
    for flag, path in (("--json", json_path), ("--plot", plot)):
        if path is not None:
            try:
                check_output_path(path)
            except OutputPathError as error:
                fail(f"{flag} {path}: {error}")
    _check_kv_scales(trace, strict, profile, kv_scales)
    thresholds = Thresholds(light_excess, overload_wait)

    base = RunSpec(POLICIES[0], rates[0], trace, profile, duration, seed, predictor, api_estimator, strict=strict,
                   prefix_cache=False)
    specs = [replace(base, policy=policy, qps=rate, kv_scale=kv, api_time_scale=api)
             for api in api_scales for kv in kv_scales for rate in rates for policy in POLICIES]
    started = time.perf_counter()
    done = 0

    def progress(record: dict) -> None:  # one line per run on stderr: these maps take minutes
        nonlocal done
        done += 1
        print(f"[{done}/{len(specs)}] {trace} {record['policy']} qps {record['qps']:g} kv×{record['kv_scale']:g} "
              f"api×{record['api_time_scale']:g}: mean {record['e2e_mean_s']:.1f} s "
              f"({record['wallclock_s']:.1f} s; {time.perf_counter() - started:.0f} s so far)",
              file=sys.stderr, flush=True)

    try:
        records = run_grid(specs, workers or None, on_done=progress)
    except ValueError as error:
        fail(str(error))
    cells = regime_cells(records, thresholds)
    print(text_table(cells), end="")
    title = f"{trace} · {records[0]['profile']} · {duration:g} s · seed {seed}"
    if json_path:
        document = {"trace": trace, "profile": records[0]["profile"], "duration_s": duration, "seed": seed,
                    "predictor": records[0]["predictor"],
                    "thresholds": {"light_excess": thresholds.light_excess,
                                   "overload_wait_fraction": thresholds.overload_wait_fraction},
                    "cells": [c.as_dict() for c in cells], "records": records}
        _write("--json", json_path, lambda: write_atomically(
            json_path, lambda f: f.write((json.dumps(document, indent=2) + "\n").encode())))
        print(f"map: {json_path}")
    if plot:
        from marsched.regime.plot import plot_regime

        _write("--plot", plot, lambda: plot_regime(cells, plot, title, thresholds, duration))
        print(f"plot: {plot}")
    print(f"{len(specs)} runs in {time.perf_counter() - started:.0f} s", file=sys.stderr)
