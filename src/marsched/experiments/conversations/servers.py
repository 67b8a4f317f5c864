"""The benchmark's servers: one per configuration, on the same model, KV cache, engine options and seed.

- `vllm`:  stock vLLM (`python -m vllm.entrypoints.launchers.api_server.entry`), prefix
  caching on (vLLM's default);
- `mars`:  `marsched serve MODEL` (policy mars, `--retention policy`);
- `fixed`: `marsched serve MODEL --retention fixed:T` (Continuum's time-to-live pinning).

Each runs in its own process group (`Server`), stopped as a whole; `server_counters` reads the
retention counters (`/marsched/state`) and vLLM's prefix cache (`/metrics`) after the load.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from marsched.experiments.conversations.load import Load
from marsched.serve.launch import stop_process_group

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} {{ c['function']['arguments'] }}\n{% endfor %}"
    "{% elif m['role'] == 'tool' %}result {{ m['content'] }}\n{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
)
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
START_TIMEOUT_S = 900.0
CONFIGS = ("vllm", "mars", "fixed")


@dataclass(frozen=True, slots=True)
class Engine:
    """What every server gets alike."""

    model: str
    kv_blocks: int = 40  # --num-gpu-blocks-override: 128-token blocks on the CPU; ~4 conversations' contexts
    max_model_len: int = 4096
    fixed_s: float | None = None  # --retention fixed:T; None: 2 x the median tool time
    extra: tuple[str, ...] = ()  # more vLLM options, for every configuration
    marsched_extra: tuple[str, ...] = ()  # more `marsched serve` options (mars and fixed), e.g. --no-swap


DEFAULT_ENGINE = Engine(model="")


def server_command(config: str, engine: Engine, load: Load, port: int, template: Path) -> list[str]:
    vllm_options = [
        "--max-model-len", str(engine.max_model_len), "--num-gpu-blocks-override", str(engine.kv_blocks),
        "--seed", str(load.seed), "--enforce-eager", "--enable-prefix-caching",
        "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        "--structured-outputs-config", '{"backend":"xgrammar","disable_any_whitespace":true}',
        "--disable-uvicorn-access-log", *engine.extra,
    ]
    if config == "vllm":
        return [sys.executable, "-m", ENTRY, "--model", engine.model, "--host", "127.0.0.1", "--port", str(port),
                *vllm_options]
    marsched = [sys.executable, "-m", "marsched.cli", "serve", engine.model, "--port", str(port),
                "--cpu-kv-cache-gib", "1", "--seed", str(load.seed)]
    if not load.conversation_keys:  # a marsched without conversation retention knows neither keys nor flag
        if config == "fixed":
            raise ValueError("the fixed configuration needs conversation retention (drop --no-conversation-keys)")
    elif config == "mars":
        marsched += ["--retention", "policy"]
    elif config == "fixed":
        marsched += ["--retention", f"fixed:{fixed_seconds(engine, load):g}"]
    else:
        raise ValueError(f"unknown configuration {config!r}; give {', '.join(CONFIGS)}")
    return marsched + [*engine.marsched_extra, "--", *vllm_options]


def fixed_seconds(engine: Engine, load: Load) -> float:
    return engine.fixed_s if engine.fixed_s is not None else 2 * load.tool_median_s


class Server:
    """One configuration's server in its own process group; `stop` ends the group."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.command, self.url, self.log = command, f"http://127.0.0.1:{port}", log
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")  # the blocks are set by --num-gpu-blocks-override
        self._log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with status {self.process.returncode} before it was healthy; "
                                   f"last lines of {self.log}:\n{tail(self.log)}")
            if get(f"{self.url}/health") is not None:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        # marsched serve stops its own vLLM group on SIGTERM; stock vLLM is the group itself.
        stop_process_group(self.process, grace_s=60.0)
        self._log.close()


@contextlib.contextmanager
def recorded_server(config: str, command: list[str], port: int, out: Path, record: dict[str, Any]) -> Iterator[Server]:
    """`config`'s server, healthy, for the body of the `with`; then stopped (its whole group, also
    on Ctrl-C) and `record` written to `out/CONFIG.json`, with the server's log path, its start
    time and, if it failed to start or the body raised a `RuntimeError`, the error."""
    log = out / "logs" / f"{config}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{config}] starting: {' '.join(command)}", flush=True)
    server = Server(command, port, log)
    try:
        began = time.monotonic()
        server.wait_healthy()
        record["start_s"] = round(time.monotonic() - began, 1)
        print(f"[{config}] healthy after {record['start_s']} s", flush=True)
        yield server
    except RuntimeError as error:
        record["error"] = str(error)
        print(f"[{config}] failed: {error}", flush=True)
    finally:
        server.stop()
        record["server_log"] = str(log)
    path = out / f"{config}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"[{config}] wrote {path}", flush=True)


def get(url: str, timeout_s: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def marsched_ranks(url: str) -> list[dict[str, Any]] | None:
    """/marsched/state as one state per rank (one without data parallelism); None for a server without
    that page (stock vLLM) or one that answered nothing."""
    state = get(f"{url}/marsched/state")
    if state is None:
        return None
    answer = json.loads(state)
    return answer.get("ranks") or [answer]


def cost_model_of(ranks: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The cost model a marsched server decides with (its first rank's under data parallelism): the
    step-time terms it learned from its own steps and their source; None without one."""
    cost = (ranks[0].get("scheduler") or {}).get("cost_model") if ranks else None
    return cost if isinstance(cost, dict) else None


def metered_cost_model(path: Path) -> dict[str, Any] | None:
    """The cost model a stock server's step meter wrote (`vllm/step_meter.py`), in `cost_model_of`'s
    form; None where it wrote none (a marsched server, or a meter that never stepped)."""
    try:
        cost = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cost if isinstance(cost, dict) else None


def server_counters(url: str, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Retention counters from /marsched/state (marsched only; `ranks`: `marsched_ranks`, fetched here when
    not given) and vLLM's prefix cache (and a KV connector's prefix hits) from /metrics."""
    counters: dict[str, Any] = {}
    if ranks is None:
        ranks = marsched_ranks(url)
    if ranks is not None:
        for key in ("retention_hits", "retention_misses", "retention_expired", "retention_released",
                    "retention_reused_tokens", "retention_yielded", "promotions"):
            values = [(rank.get("scheduler") or {}).get(key) for rank in ranks]
            if any(isinstance(v, (int, float)) for v in values):
                counters[key] = sum(v for v in values if isinstance(v, (int, float)))
    metrics = get(f"{url}/metrics")
    if metrics is not None:
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics.decode()):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        for ours, theirs in (("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
                             ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
                             ("preemptions", "vllm:num_preemptions_total"),
                             # a KV connector's hits (the host prefix tier's), in tokens
                             ("external_prefix_cache_queries", "vllm:external_prefix_cache_queries_total"),
                             ("external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total")):
            if theirs in sums:
                counters[ours] = sums[theirs]
        if counters.get("prefix_cache_queries"):
            counters["prefix_cache_hit_rate"] = counters.get("prefix_cache_hits", 0) / counters["prefix_cache_queries"]
    return counters
