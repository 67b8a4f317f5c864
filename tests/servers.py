"""Live `marsched serve` servers for the tests (tiny model, CPU, loopback), shared across modules.

A server takes longer to start than most of its tests take to run, so there is one per
configuration, not one per module (started and stopped by `shared.SharedPool`): `CHAT` for
plain requests and client-side tool calls (test_serve, test_serve_conversations,
test_serve_metrics), `TOOLS` for server-side tools and a small KV cache (test_serve_tools,
test_serve_retention_pressure), `DATA_PARALLEL` and `LOADGEN` for one module each, started in
the background before their tests come. Tests on one server check only their own requests, or
counters relative to their start, and leave it idle.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engines import KV_BLOCKS

START_TIMEOUT_S = float(os.environ.get("MARSCHED_TEST_START_TIMEOUT_S", "300"))  # longer on a loaded machine

# Renders tool calls and results as text; plain messages as their content, one per line.
TOOL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} {{ c['function']['arguments'] }}\n{% endfor %}"
    "{% elif m['role'] == 'tool' %}result {{ m['content'] }}\n{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
)
# Blocks of 32 tokens (the CPU backend's least), so that short conversations fill some; a named
# tool_choice makes the random model write a valid call (structured output, JSON without whitespace).
TOOL_ARGS = ("--block-size", "32", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
             "--structured-outputs-config", '{"backend":"xgrammar","disable_any_whitespace":true}')


class Server:
    def __init__(self, model: str, folder: Path, template: str = TOOL_TEMPLATE, serve_args: tuple[str, ...] = (),
                 vllm_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        import httpx
        import psutil

        from marsched.serve.launch import free_port

        self._psutil = psutil
        self.model = model
        self.folder = folder
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.trace = folder / "trace.jsonl"
        self.log = folder / "serve.log"
        (folder / "chat.jinja").write_text(template)
        command = [sys.executable, "-m", "marsched.cli", "serve", model, "--port", str(self.port),
                   "--cpu-kv-cache-gib", "1", "--trace-out", str(self.trace), *serve_args,
                   "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                   "--chat-template", str(folder / "chat.jinja"), *vllm_args]
        self._log_file = open(self.log, "w")
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, **(env or {})})
        self.descendants: dict[int, object] = {}
        self.client = httpx.Client(timeout=60)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "marsched serve: listening on" not in self.log.read_text():
            assert self.process.poll() is None, f"marsched serve exited:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.5)
        self.note_descendants()

    def note_descendants(self) -> None:
        try:
            children = self._psutil.Process(self.process.pid).children(recursive=True)
        except self._psutil.NoSuchProcess:  # stopped already
            return
        for child in children:
            self.descendants.setdefault(child.pid, child)

    def alive(self) -> list:
        psutil = self._psutil
        processes = [psutil.Process(self.process.pid)] if self.process.poll() is None else []
        living = []
        for process in processes + list(self.descendants.values()):
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    living.append(process)
            except psutil.NoSuchProcess:
                pass
        return living

    def stop(self, signum: int = signal.SIGINT, timeout_s: float = 90.0) -> int | None:
        self.note_descendants()
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.process.poll()

    def kill_leftovers(self) -> None:
        for process in self.alive():
            try:
                process.kill()
            except self._psutil.NoSuchProcess:
                pass
        self.process.wait(10)
        self.client.close()
        self._log_file.close()

    def close(self) -> None:
        """Stop it as Ctrl-C does, then kill whatever it left (again: a no-op)."""
        self.stop()
        self.kill_leftovers()

    # --- HTTP ------------------------------------------------------------------------

    def post(self, path: str, body=None, raw: bytes | None = None):
        content = raw if raw is not None else json.dumps(body).encode()
        return self.client.post(self.url + path, content=content, headers={"content-type": "application/json"})

    def state(self) -> dict:
        response = self.client.get(self.url + "/marsched/state")
        assert response.status_code == 200, response.text
        return response.json()

    def kv_usage_metric(self) -> float:
        for line in self.client.get(self.url + "/metrics").text.splitlines():
            if line.startswith("vllm:kv_cache_usage_perc{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")

    def arrivals(self) -> int:
        from marsched.metrics.trace import read_trace

        return sum(1 for e in read_trace(self.trace) if e["event"] == "arrive") if self.trace.exists() else 0


@contextlib.contextmanager
def started(model: str, folder: Path, **options):
    """A `Server` of its own once it listens; stopped, with every process it started, at the end."""
    running = Server(model, folder, **options)
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


# --- the shared configurations -----------------------------------------------------------------

TOOLS_MODULE = '''
import asyncio, json, time

RECORD = {record!r}

def _note(name, args, event="call"):
    with open(RECORD, "a") as f:
        f.write(json.dumps({{"tool": name, "args": args, "event": event, "t": time.time()}}) + "\\n")

def weather(args):
    """The weather in a city."""
    _note("weather", args)
    return "sunny in " + args["city"]

def boom(args):
    _note("boom", args)
    raise RuntimeError("kaboom")

async def slow(args):
    _note("slow", args)
    await asyncio.sleep(5)
    return "too late"

def number(args):
    _note("number", args)
    return 42

def garbage(args):
    _note("garbage", args)
    return "a\\x00b\\ud800c"  # a NUL and a lone surrogate: no tokenizer or JSON parser takes them

async def nap(args):
    _note("nap", args)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        _note("nap", args, "cancelled")
        raise
    return "rested"
'''
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]}},
        "required": ["city"], "additionalProperties": False}
# A client-side tool (no server registers it): the conversations' tool turns call it.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": CITY}}
EXPRESSION = {"type": "object", "properties": {"expression": {"type": "string", "enum": ["6*7"]}},
              "required": ["expression"], "additionalProperties": False}
TOOLS_MODULE_NAME = "srv_tools_fixture"


def tool_calls_record(folder: Path) -> Path:
    """Where the tools of `TOOLS` write one line per call (and per cancellation)."""
    return folder / "calls.jsonl"


def write_tools(folder: Path) -> Path:
    """The server-side tools of `TOOLS`: a module of Python functions and the tools file naming them."""
    (folder / f"{TOOLS_MODULE_NAME}.py").write_text(TOOLS_MODULE.format(record=str(tool_calls_record(folder))))

    def fn(name: str, **extra) -> dict:
        return {"name": name, "function": f"{TOOLS_MODULE_NAME}:{name}", "parameters": CITY, **extra}

    config = {"tools": [{"name": "calculator", "builtin": "calculator", "parameters": EXPRESSION},
                        fn("weather", expected_s=0.5), fn("boom"), fn("slow", timeout_s=0.5), fn("number"),
                        fn("garbage"), fn("nap", timeout_s=120)],
              "max_rounds": 3}
    path = folder / "tools.json"
    path.write_text(json.dumps(config))
    return path


@dataclass(frozen=True)
class ServerConfig:
    name: str  # the session fixture that hands it out (conftest.py)
    serve_args: Callable[[Path], tuple[str, ...]]  # from the server's folder (files it needs are written there)
    vllm_args: tuple[str, ...] = ()
    env: Callable[[Path], dict[str, str]] = field(default=lambda folder: {})

    def __call__(self, model: str, folder: Path) -> Server:
        """A server of this configuration in `folder`, starting (`shared.SharedPool`'s factory)."""
        return Server(model, folder, serve_args=self.serve_args(folder), vllm_args=self.vllm_args,
                      env=self.env(folder))


CHAT_RETENTION_LIMIT_S = 8.0  # short: a follow-up that never comes is freed within a test
TOOLS_RETENTION_LIMIT_S = 120.0  # long: a kept turn outlives the traffic sent past it
TOOLS_BLOCKS = 48  # so that a few long prompts fill the KV cache

CHAT = ServerConfig("chat_server", lambda folder: ("--retention-limit-s", str(CHAT_RETENTION_LIMIT_S)),
                    (*TOOL_ARGS, "--num-gpu-blocks-override", str(KV_BLOCKS)))  # as the shared engines
TOOLS = ServerConfig(
    "tools_server",
    lambda folder: ("--tools", str(write_tools(folder)), "--retention-limit-s", str(TOOLS_RETENTION_LIMIT_S)),
    (*TOOL_ARGS, "--num-gpu-blocks-override", str(TOOLS_BLOCKS), "--enable-log-requests"),
    # The server imports the tools module from its folder.
    lambda folder: {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)},
)
DP_RETENTION_LIMIT_S = 15.0  # far past any follow-up in its tests, short enough to wait out once
# Two data-parallel ranks (test_serve_data_parallel.py), each with the default KV cache.
DATA_PARALLEL = ServerConfig("dp_server", lambda folder: ("--retention-limit-s", str(DP_RETENTION_LIMIT_S)),
                             ("--data-parallel-size", "2", *TOOL_ARGS))
# `marsched loadgen`'s target (test_loadgen_live.py). The oracle predictor ranks by what the request
# says (its max_tokens), so every `predict` event shows exactly what reached the scheduler: a
# reply-length target would appear there.
LOADGEN = ServerConfig("loadgen_server", lambda folder: ("--bench-reply-lengths", "--predictor", "oracle"),
                       ("--max-model-len", "4096"))
SHARED = {config.name: config for config in (CHAT, TOOLS, DATA_PARALLEL, LOADGEN)}


# --- requests ----------------------------------------------------------------------------------

def completion(server: Server, **fields) -> dict:
    return {"model": server.model, "prompt": "the quick brown fox", "max_tokens": 4, **fields}


def wait_idle(server: Server, timeout_s: float = 20.0) -> dict:
    """The server's state once nothing runs, waits or is kept, on the device or the host."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.state()
        sched = state.get("scheduler") or {}
        idle = (sched.get("tracked") == 0 and sched.get("device_free_blocks") == sched.get("device_total_blocks")
                and sched.get("host_tokens") == 0 and state["host_bytes"] == 0)
        if idle and server.kv_usage_metric() == 0.0:
            return state
        assert time.monotonic() < deadline, f"KV usage never returned to zero: {state}"
        time.sleep(0.2)


def openai_client(server: Server):
    """The official client on `server`, for a module's fixture (it closes the client when done)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def marsched(**fields) -> dict:
    """A request's extra body with these marsched fields (a JSON string, as over HTTP)."""
    return {"vllm_xargs": {"marsched": json.dumps(fields)}}
