"""The `marsched loadgen` command (registered in `marsched.cli`); docs/loadgen.md is its manual."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from marsched.cli_checks import check_outputs, checked, fail, write_or_fail
from marsched.cli_output import console, errors, progress
from marsched.loadgen.arrivals import Arrival, session_arrivals
from marsched.loadgen.client import ServerError, ServerInfo, open_client, probe, send_turn, server_info
from marsched.loadgen.options import WORKLOADS, LoadgenOptions, load_sessions
from marsched.loadgen.records import TurnRecord
from marsched.loadgen.replay import GapShape, ReplayResult, replay
from marsched.loadgen.report import build_report, write_report

INTERRUPTED_EXIT = 130  # as a shell reports a command ended by Ctrl-C
_NOT_FORCED = ("the server did not end a 3-token probe reply at 3 tokens: reply lengths will not follow the trace. "
               "Start marsched serve with --bench-reply-lengths, or vLLM with "
               "--logits-processors marsched.loadgen.reply_length:BenchReplyLength")


@dataclass(slots=True)
class Outcome:
    server: ServerInfo
    forced: bool
    result: ReplayResult


async def _run(options: LoadgenOptions, url: str, api_key: str, arrivals: list[Arrival]) -> Outcome:
    client = open_client(url, options.request_timeout_s, api_key)
    try:
        server = await server_info(client, options.model)
        forced = await probe(client, server.model, options.conversation_keys, time.monotonic())
        if not forced:
            errors.print(f"[bold yellow]warning:[/] {_NOT_FORCED}", highlight=False, soft_wrap=True, markup=True)
        total = sum(len(a.session.turns) for a in arrivals)  # a subagent whose parent fails never starts
        errors.print(f"loadgen: {len(arrivals)} conversations ({total} turns) of {options.workload} against "
                     f"{server.model} at {url}; Ctrl-C stops and keeps what was measured",
                     highlight=False, soft_wrap=True)

        clock0 = time.monotonic()

        async def send(prompt: str, turn: TurnRecord, conversation: str, last: bool) -> str:
            # A conversation's last turn says so (`retain: false`): a marsched server then keeps
            # nothing of it and counts its program as ended, as a client's final answer lets it.
            return await send_turn(client, server.model, prompt, turn, max_tokens=options.max_tokens,
                                   conversation=conversation if options.conversation_keys else None,
                                   clock0=clock0, timeout_s=options.request_timeout_s,
                                   retain=not last, oracle=options.oracle_predictions)

        with progress() as bar:
            task = bar.add_task("turns", total=total)
            result = await replay(arrivals, send, GapShape(options.gap_scale, options.max_gap_s),
                                  on_turn=lambda n: bar.advance(task, n), clock0=clock0,
                                  max_concurrency=options.max_concurrency)
        return Outcome(server, forced, result)
    finally:
        await client.close()


def _print_summary(report: dict[str, Any]) -> None:
    turns, convs = report["turns"], report["conversations"]

    def triple(group: dict[str, Any], name: str) -> str:
        values = [group[f"{name}_{k}_s"] for k in ("mean", "p50", "p99")]
        return "-" if values[0] is None else " / ".join(f"{v:.3f}" for v in values)

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"turns: {turns['finished']}/{turns['sent']} finished, {turns['failed']} failed, "
        f"{turns['exact_length']} of the trace's length; latency mean/p50/p99 {triple(turns, 'e2e')} s; "
        f"follow-up TTFT {triple(turns, 'followup_ttft')} s; {rate(turns['per_s'])} turns/s, "
        f"{rate(turns['output_tokens_per_s'])} output tokens/s",
        f"conversations: {convs['finished']}/{convs['started']} finished, {convs['failed']} failed, "
        f"{convs['unfinished']} unfinished; latency mean/p50/p99 {triple(convs, 'e2e')} s; "
        f"{rate(convs['per_s'])} conversations/s",
    ]
    lines += [f"error ({count}x): {message}" for message, count in list(report["errors"].items())[:3]]
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def loadgen(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server, e.g. http://127.0.0.1:8000 (any "
                                                           "OpenAI-compatible server; /v1 is added).")],
    workload: Annotated[str, typer.Option(help=f"What to replay: {', '.join(WORKLOADS)} (docs/loadgen.md).")] = (
        "agent-text"),
    model: Annotated[str | None, typer.Option(help="The served model's name (default: the first that "
                                                   "/v1/models lists).")] = None,
    rate: Annotated[float, typer.Option(help="Conversations arriving per second (Poisson).")] = 0.2,
    duration: Annotated[float, typer.Option(help="Seconds of arrivals; the run then waits for every "
                                                 "conversation to end.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Seed of the arrivals and of the sessions drawn (0 to 2^32-1).")] = 0,
    gap_scale: Annotated[float, typer.Option(help="Multiply every tool gap between turns by this.")] = 1.0,
    max_gap_s: Annotated[float | None, typer.Option(help="Cap every tool gap at this many seconds "
                                                         "(after --gap-scale).")] = None,
    token_scale: Annotated[float, typer.Option(help="claude-code only: multiply the trace's token counts "
                                                    "(prompts, replies, tool results) by this.")] = 1.0,
    max_turns: Annotated[int, typer.Option(help="Replay only each conversation's first N turns "
                                                "(0: all).")] = 0,
    turn_chars: Annotated[int, typer.Option(help="agent-text only: cut every turn's new text and every reply to "
                                                 "its first N characters, prompts rebuilt from the cut pieces "
                                                 "(0: whole turns).")] = 0,
    reply_chars: Annotated[int | None, typer.Option(help="With --turn-chars: cut every reply to its first N "
                                                         "characters instead (0: whole replies).")] = None,
    sessions: Annotated[str, typer.Option(help="agent-text only: all, or held-out (only the sessions the "
                                               "packaged agent head never trained on).")] = "all",
    max_concurrency: Annotated[int, typer.Option(help="Run at most N conversations at once; the others wait "
                                                      "for one to end, and their latency counts from then "
                                                      "(0: no limit).")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Every turn's max_tokens: one fixed cap, so that it tells "
                                                 "the scheduler nothing of the reply's length.")] = 4096,
    conversation_keys: Annotated[bool, typer.Option(help="Send vllm_xargs.marsched = {\"conversation\": ID} "
                                                         "with every turn (stock vLLM ignores it).")] = True,
    request_timeout: Annotated[float, typer.Option(help="Seconds a turn may take before it counts as "
                                                        "failed.")] = 600.0,
    oracle_predictions: Annotated[bool, typer.Option(help="A diagnostic, not a benchmark: every turn tells a marsched "
                                                          "server its reply's length as its predicted output "
                                                          "(vllm_xargs.marsched.predicted), to see what exact "
                                                          "predictions would give.")] = False,
    api_key: Annotated[str, typer.Option(envvar="OPENAI_API_KEY", show_envvar=True,
                                         help="Bearer token, if the server wants one.")] = "EMPTY",
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here (also after Ctrl-C, marked "
                                                  "interrupted).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the latency distributions here.")] = None,
) -> None:
    """Replay multi-turn agent conversations against an OpenAI-compatible server and measure them.

    Conversations arrive as a Poisson process; inside each, the next turn is sent when the previous reply has ended and the trace's tool gap has passed. With the server's bench processor (marsched serve --bench-reply-lengths) every reply has the trace's length. Ctrl-C stops the run and keeps what was measured. docs/loadgen.md has the details.
    """
    options = LoadgenOptions(url, workload, model, rate, duration, seed, gap_scale, max_gap_s, token_scale,
                             max_turns, max_tokens, conversation_keys, request_timeout, turn_chars, sessions,
                             max_concurrency, oracle_predictions, reply_chars)
    root = checked(options.check)
    check_outputs(out=out, plot=plot)
    sessions = checked(lambda: load_sessions(options))
    arrivals = session_arrivals(sessions, rate, duration, seed)
    if not arrivals:
        fail(f"--rate {rate:g} --duration {duration:g}: no conversation arrives; raise one of them")
    try:
        outcome = asyncio.run(_run(options, root, api_key, arrivals))
    except ServerError as error:
        fail(f"{root}: {error}")
    server = {"url": root, "model": outcome.server.model, "models": list(outcome.server.models),
              "max_model_len": outcome.server.max_model_len, "reply_lengths_forced": outcome.forced}
    settings = {**options.settings(), "sessions": len(sessions)}
    report = build_report(settings, server, outcome.result.conversations, wall_s=outcome.result.wall_s,
                          interrupted=outcome.result.interrupted)
    if outcome.result.interrupted:
        errors.print("loadgen: interrupted; the report holds what finished", highlight=False, soft_wrap=True)
    _print_summary(report)
    if out:
        write_or_fail("--out", out, lambda: write_report(out, report))
        console.print(f"report: {out}", highlight=False)
    if plot:
        write_or_fail("--plot", plot, lambda: _plot(report, plot))
        console.print(f"plot: {plot}", highlight=False)
    if outcome.result.interrupted:
        raise typer.Exit(INTERRUPTED_EXIT)


def _plot(report: dict[str, Any], path: Path) -> None:
    from marsched.loadgen.plot import plot_report

    plot_report(report, path)
