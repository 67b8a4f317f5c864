"""The `marsched` command."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from marsched.bench.report import plot_latency, write_json
from marsched.bench.runner import RunSpec, grid, run_grid, run_one
from marsched.policy.registry import POLICY_NAMES, STARVATION_NAMES, parse_threshold
from marsched.sim.profile import profile_names
from marsched.workload.errors import TraceWarning
from marsched.workload.loader import TRACE_NAMES, load_trace

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="MARS scheduling for augmented LLM requests: simulate and compare policies.")
# Wide enough for the comparison table when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)

TraceOpt = Annotated[str, typer.Option(
    help=f"Trace file (.json INFERCEPT/MARS format, .jsonl ours) or a bundled trace: {', '.join(TRACE_NAMES)} "
         "('bundled' is single).")]
StrictOpt = Annotated[bool, typer.Option(
    "--strict", help="Reject trace values that are otherwise read leniently with a warning (negative API returns).")]
ProfileOpt = Annotated[str, typer.Option(help="Profile name or path to a profile .json.")]
DurationOpt = Annotated[float, typer.Option(help="Seconds of Poisson arrivals; the run then drains.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for arrivals and noisy predictions.")]
PredictorOpt = Annotated[str, typer.Option(help="Output-length predictor: oracle or noisy:SIGMA.")]
ApiOpt = Annotated[str, typer.Option("--api-estimator", help="API-duration estimate: type-mean or oracle.")]
StarvationOpt = Annotated[str, typer.Option(
    help="Starvation threshold in the variant's units (seconds for 'age', iterations for the others), 'off', or 'default'.")]
VariantOpt = Annotated[str, typer.Option(
    "--starvation", help=f"Starvation prevention variant: {', '.join(STARVATION_NAMES)}, or 'default' (age for mars, off for the others).")]
AdmissionOpt = Annotated[str, typer.Option(
    help="Admission: greedy, predicted-peak, or 'default' (predicted-peak for mars, greedy for the others).")]
RefreshOpt = Annotated[int, typer.Option(help="Recompute ranking keys every k iterations.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the metrics records (a JSON list) here.")]


def _fail(message: str) -> None:
    errors.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def _threshold(text: str) -> int | None | str:
    return "default" if text == "default" else parse_threshold(text)


def _numbers(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{what} {text!r}: give comma-separated numbers, e.g. 3,4,5,6")
    if not values or any(v <= 0 for v in values):
        _fail(f"{what} {text!r}: give positive numbers, e.g. 3,4,5,6")
    return values


def _table(records: list[dict]) -> Table:
    table = Table(title="end-to-end latency (s), time to first token (s)", header_style="bold")
    for column in ("qps", "policy", "e2e mean", "e2e p50", "e2e p99", "ttft mean", "ttft p99",
                   "× isolated", "max wait", "preempt", "strategies", "finished"):
        table.add_column(column, justify="left" if column in ("policy", "strategies") else "right")
    for r in sorted(records, key=lambda r: (r["qps"], r["policy"])):
        strategies = " ".join(f"{k[0].upper()}{v}" for k, v in r["strategy_counts"].items())
        table.add_row(
            f"{r['qps']:g}", r["policy"], f"{r['e2e_mean_s']:.2f}", f"{r['e2e_p50_s']:.2f}", f"{r['e2e_p99_s']:.2f}",
            f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['e2e_mean_s'] / r['isolated_e2e_mean_s']:.3f}",
            f"{r['max_queue_wait_s']:.1f}", str(r["preemptions"]), strategies, f"{r['num_finished']}/{r['num_requests']}",
        )
    return table


@contextmanager
def _trace_warnings_once() -> Iterator[None]:
    """Print each distinct TraceWarning once, as one line on stderr, however often the trace is loaded.

    A run loads its trace more than once (here to fail early, again in each worker);
    workers forked from this process inherit the set of warnings already shown.
    """
    shown: set[str] = set()
    default_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, TraceWarning):
            default_show(message, category, filename, lineno, file, line)
        elif str(message) not in shown:
            shown.add(str(message))
            errors.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always", TraceWarning)
        warnings.showwarning = show
        yield


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=errors, transient=True, disable=not sys.stderr.isatty())


@app.command()
def simulate(
    policy: Annotated[str, typer.Option(help=f"One of: {', '.join(POLICY_NAMES)}.")] = "mars",
    qps: Annotated[float, typer.Option(help="Arrival rate, requests per second.")] = 4.0,
    trace: TraceOpt = "bundled",
    profile: ProfileOpt = "gptj-6b-a100",
    duration: DurationOpt = 600.0,
    seed: SeedOpt = 0,
    predictor: PredictorOpt = "oracle",
    api_estimator: ApiOpt = "type-mean",
    starvation_threshold: StarvationOpt = "default",
    starvation: VariantOpt = "default",
    admission: AdmissionOpt = "default",
    refresh_interval: RefreshOpt = 1,
    json_path: JsonOpt = None,
    trace_out: Annotated[Path | None, typer.Option(help="Write the event trace (JSONL) here.")] = None,
    strict: StrictOpt = False,
) -> None:
    """Simulate one policy at one arrival rate."""
    try:
        if qps <= 0 or duration <= 0:
            raise ValueError("--qps and --duration must be positive")
        spec = RunSpec(policy, qps, trace, profile, duration, seed, predictor, api_estimator,
                       _threshold(starvation_threshold), refresh_interval, str(trace_out) if trace_out else None,
                       strict=strict, starvation=starvation, admission=admission)
        spec.build()
        with _trace_warnings_once():
            templates = load_trace(trace, strict=strict)
        with _progress() as progress:
            task = progress.add_task(f"{policy} @ {qps:g} qps", total=None)
            record = run_one(spec, templates, on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    except ValueError as error:
        _fail(str(error))
    console.print(_table([record]))
    if json_path:
        write_json([record], json_path)
        console.print(f"metrics: {json_path}")
    if trace_out:
        console.print(f"event trace: {trace_out}")


@app.command()
def compare(
    policies: Annotated[str, typer.Option(help="Comma-separated policy names.")] = "vllm,infercept,mars",
    qps: Annotated[str, typer.Option(help="Comma-separated arrival rates.")] = "3,4,5,6",
    trace: TraceOpt = "bundled",
    profile: ProfileOpt = "gptj-6b-a100",
    duration: DurationOpt = 600.0,
    seed: SeedOpt = 0,
    predictor: PredictorOpt = "oracle",
    api_estimator: ApiOpt = "type-mean",
    starvation_threshold: StarvationOpt = "default",
    starvation: VariantOpt = "default",
    admission: AdmissionOpt = "default",
    refresh_interval: RefreshOpt = 1,
    json_path: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of mean and p99 latency against QPS.")] = None,
    workers: Annotated[int, typer.Option(help="Parallel processes (0: one per core).")] = 0,
    strict: StrictOpt = False,
) -> None:
    """Run several policies at several arrival rates on the same workload and engine."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    rates = _numbers(qps, "--qps")
    try:
        base = RunSpec(names[0] if names else "", rates[0], trace, profile, duration, seed, predictor,
                       api_estimator, _threshold(starvation_threshold), refresh_interval, strict=strict,
                       starvation=starvation, admission=admission)
        if duration <= 0:
            raise ValueError("--duration must be positive")
        specs = grid(base, names, rates)
        if not specs:
            raise ValueError(f"--policies: name at least one of {', '.join(POLICY_NAMES)}")
        with _trace_warnings_once():  # the workers load the trace again; its warnings show once
            load_trace(trace, strict=strict)  # a bad trace fails here, before any process starts
            with _progress() as progress:
                task = progress.add_task(f"{len(specs)} runs", total=len(specs))
                records = run_grid(specs, workers or None, on_done=lambda _: progress.advance(task))
    except ValueError as error:
        _fail(str(error))
    console.print(_table(records))
    if json_path:
        write_json(records, json_path)
        console.print(f"metrics: {json_path}")
    if plot:
        plot_latency(records, plot)
        console.print(f"plot: {plot}")


@app.command("list")
def list_names() -> None:
    """The policies and profiles there are."""
    console.print("policies: " + ", ".join(POLICY_NAMES))
    console.print("starvation variants: " + ", ".join(STARVATION_NAMES))
    console.print("profiles: " + ", ".join(profile_names()))


# Real vLLM: `marsched model` builds a random-weight model, `marsched bench` replays a trace on it.
from marsched.bench.commands import bench as _bench, model as _model  # noqa: E402

app.command("model")(_model)
app.command("bench")(_bench)


if __name__ == "__main__":
    app()
