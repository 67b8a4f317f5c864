"""The soak: the probe's fault mix against stock vLLM and `marsched serve`, one after the other.

Per configuration: start its server (the conversation benchmark's, with the probe's server
tools on marsched), run `--clients` clients for `--duration` seconds while sampling the
server's memory, wait `--idle-s` (past the retention limit), then read what it still holds.
A JSON record per configuration and a Markdown table go to `--out`. Exit status 0 when the
marsched server saw no fault, stayed alive and held nothing after the wait.

    python -m marsched.experiments.probe --duration 600            # the 10-minute soak
    python -m marsched.experiments.probe --duration 60 --clients 8  # a short look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from marsched.experiments.conversations.load import DEFAULT_LOAD
from marsched.experiments.conversations.report import fmt
from marsched.experiments.conversations.run import build_model, commit, stop_on_signals, versions
from marsched.experiments.conversations.servers import CHAT_TEMPLATE, Engine, recorded_server, server_command
from marsched.experiments.conversations.soak import HELD, RssSampler, after_idle
from marsched.experiments.probe.actions import Target
from marsched.experiments.probe.load import run_clients, summarize
from marsched.experiments.probe.tools import TOOLS, write_tools_file
from marsched.serve.launch import free_port

CONFIGS = ("vllm", "mars")


def leaks(left: dict[str, Any]) -> dict[str, Any]:
    """What `after_idle` found still held: any of `HELD` above zero (marsched's counters; stock vLLM
    has none of them)."""
    return {key: left[key] for key in HELD if left.get(key)}


def healthy(record: dict[str, Any]) -> bool:
    """No fault, no engine death, nothing held after the wait."""
    left = record.get("after_idle") or {}
    summary = record.get("summary") or {}
    return ("error" not in record and "died" not in record and summary.get("faults") == 0
            and left.get("alive") is True and left.get("health") is True and not leaks(left))


def run_config(config: str, engine: Engine, args: argparse.Namespace, out: Path, workdir: Path) -> dict[str, Any]:
    port = free_port("127.0.0.1")
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    tools = write_tools_file(workdir)
    if config == "mars":
        engine = replace(engine, marsched_extra=("--tools", str(tools), "--retention-limit-s",
                                                 f"{args.retention_limit_s:g}", *engine.marsched_extra))
    command = server_command(config, engine, replace(DEFAULT_LOAD, seed=args.seed), port, template)
    record: dict[str, Any] = {"config": config, "command": command, "engine": asdict(engine),
                              "clients": args.clients, "duration_s": args.duration, "idle_s": args.idle_s,
                              "seed": args.seed, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "load_average": list(os.getloadavg()), "versions": versions(), "commit": commit()}
    with recorded_server(config, command, port, out, record) as server:
        target = Target(server.url, engine.model, marsched=config == "mars",
                        server_tools=TOOLS if config == "mars" else (), max_model_len=engine.max_model_len)
        print(f"[{config}] {args.clients} clients for {args.duration:g} s", flush=True)
        sampler = RssSampler(server.process.pid)
        outcomes = asyncio.run(run_clients(target, args.clients, args.duration, args.seed,
                                           progress=lambda line: print(f"[{config}] {line}", flush=True),
                                           server_gone=lambda: server.process.poll() is not None))
        if server.process.poll() is not None:
            record["died"] = f"the server exited with status {server.process.returncode} during the load"
            print(f"[{config}] {record['died']}; see {server.log}", flush=True)
        record["rss"] = sampler.stop()
        record["summary"] = summarize(outcomes)
        print(f"[{config}] load done ({record['summary']['faults']} faults); waiting {args.idle_s:g} s", flush=True)
        record["after_idle"] = after_idle(server.url, server.process, args.idle_s)
        record["exit_status"] = server.process.poll()
    return record


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| config | actions | requests | 2xx / 4xx / 5xx / no answer | faults | alive, health "
             "| RSS start / peak / end MiB | RSS growth MiB | held after the wait |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        s, rss, left = r.get("summary") or {}, r.get("rss") or {}, r.get("after_idle") or {}
        st = s.get("statuses") or {}
        held = leaks(left) if r["config"] == "mars" else {"kv_cache_usage": left.get("kv_cache_usage")}
        lines.append(
            f"| {r['config']}{' (died)' if 'died' in r else ''} "
            f"| {s.get('actions_run', '–')} | {s.get('requests', '–')} "
            f"| {st.get('2xx', 0)} / {st.get('4xx', 0)} / {st.get('5xx', 0)} / {st.get('no answer', 0)} "
            f"| {s.get('faults', '–')} | {left.get('alive', '–')}, {left.get('health', '–')} "
            f"| {fmt(rss.get('start_mib'), 0)} / {fmt(rss.get('peak_mib'), 0)} / {fmt(rss.get('end_mib'), 0)} "
            f"| {fmt(rss.get('growth_mib'), 0)} | {', '.join(f'{k} {v}' for k, v in held.items()) or 'nothing'} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m marsched.experiments.probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="model directory (default: build `marsched model` into --model-dir)")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "marsched-convbench-model"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load per configuration")
    p.add_argument("--retention-limit-s", type=float, default=30.0, help="marsched's --retention-limit-s")
    p.add_argument("--idle-s", type=float, default=45.0, help="the wait after the load, before reading what is held")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=Engine(model="").kv_blocks, help="KV blocks (128 tokens each)")
    p.add_argument("--out", default="results/probe", help="one JSON record per configuration, and table.md")
    p.add_argument("--vllm-arg", action="append", default=[],
                   help="one more vLLM option for every server (repeat), e.g. --vllm-arg=--data-parallel-size=2")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; give some of {', '.join(CONFIGS)}")
    for name in ("clients", "duration", "idle_s", "retention_limit_s", "kv_blocks"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, not {getattr(args, name)}")
    if args.idle_s <= args.retention_limit_s:
        p.error(f"--idle-s ({args.idle_s:g}) must exceed --retention-limit-s ({args.retention_limit_s:g}): "
                "what clients abandon is freed only at the limit")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: not a directory (the records go in it, one file per configuration)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        p.error(f"--out {out}: cannot create it ({error.strerror})")
    if not os.access(out, os.W_OK):
        p.error(f"--out {out}: not writable")
    args.configs = configs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop_on_signals()
    out = Path(args.out)
    model = args.model or build_model(Path(args.model_dir))
    engine = Engine(model=model, kv_blocks=args.kv_blocks, extra=tuple(args.vllm_arg))
    records = []
    with tempfile.TemporaryDirectory(prefix="probe-") as scratch:
        try:
            for config in args.configs:
                records.append(run_config(config, engine, args, out, Path(scratch)))
        except KeyboardInterrupt:
            print("interrupted; the server was stopped", flush=True)
            return 130
    text = table(records)
    print()
    print(text)
    (out / "table.md").write_text(text + "\n")
    mars = [r for r in records if r["config"] == "mars"]
    return 0 if all(healthy(r) for r in mars) else 1


if __name__ == "__main__":
    sys.exit(main())
