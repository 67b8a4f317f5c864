"""The configurations compared and the command that starts each one's server.

Every server gets the same model, KV cache (`--num-gpu-blocks-override`), context length,
engine options and seed; only the scheduler differs:

- `vllm-stock`: stock vLLM's OpenAI server (the module `python -m vllm.entrypoints.openai.api_server`
  runs, and `marsched serve` too), prefix caching on, with the bench's reply-length processor. Its
  scheduler is vLLM's own, with a step meter beside it (`--scheduler-cls
  marsched.vllm.step_meter.MeteredScheduler`: every decision vLLM's, each step timed into the cost
  model a marsched server learns, so the twin simulates stock vLLM at its own step costs);
- `vllm-stock-host`: the same stock server with a host prefix tier (`marsched.vllm.prefix_tier`, a KV
  connector: finished requests' full blocks kept in host memory by block hash, LRU, loaded back on a
  prefix hit) of the host memory the marsched configurations' Swap connector gets
  (`MarsConfig.host_swap_tokens`); vLLM's own OffloadingConnector refuses the CPU. With a KV connector
  vLLM reserves one core more for its engine core, so it is told to reserve what stock vLLM does
  (`VLLM_CPU_NUM_OF_RESERVED_CPU`, as `marsched serve` does): every server computes on the same cores;
- `vllm`: `marsched serve --policy vllm` (stock vLLM's rule inside marsched's scheduler plugin);
- `infercept`: `marsched serve --policy infercept`;
- `continuum`: `marsched serve --policy mars --retention fixed:T`: every conversation's KV is
  pinned on the device for T seconds after each turn, Continuum's time-to-live idea on MARS's
  server (MARS's ranking), not Continuum's own scheduler;
- `autellix`: `marsched serve --policy autellix`: Autellix's program-level least attained
  service (PLAS, arXiv 2502.13965 §4.2), each program's service counted across its turns, each
  turn ending its request (the prefix cache serves the follow-up);
- `mars`: `marsched serve` with its defaults (policy mars, retention policy, predictor auto:
  the learned one where the predict extra is installed);
- `mars-oracle`, a diagnostic left out of the default list and of the best-other comparison:
  `mars`'s server, with loadgen telling it every reply's length (`--oracle-predictions`), to see
  what exact predictions would give on the same load.

Every marsched server gets `--bench-reply-lengths`. The old conversation benchmark's
`Server` (process group, health, stop) and vLLM entry point are reused, not copied.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from marsched.atomic import OutputPathError, check_output_folder
from marsched.experiments.conversations.servers import ENTRY
from marsched.loadgen.reply_length import PROCESSOR
from marsched.loadgen.session import Session, shape_gap
from marsched.serve.launch import stock_reserved_cores
from marsched.vllm.config import MarsConfig
from marsched.vllm.step_clock import METER_ENV, METERED_SCHEDULER

CONFIGS = ("vllm-stock", "vllm-stock-host", "vllm", "infercept", "continuum", "autellix", "mars")
BASELINE = "vllm-stock"
STOCK_HOST = "vllm-stock-host"
FOCUS = "mars"  # the configuration the summary compares with the best of the others
ORACLE = "mars-oracle"  # a diagnostic: FOCUS told the true lengths; never a baseline
KNOWN = (*CONFIGS, ORACLE)

DESCRIPTIONS = {
    "vllm-stock": "stock vLLM OpenAI server, prefix caching on",
    STOCK_HOST: "stock vLLM OpenAI server, prefix caching on, a host prefix tier of the Swap connector's host memory",
    "vllm": "marsched serve --policy vllm",
    "infercept": "marsched serve --policy infercept",
    "continuum": ("marsched serve --policy mars --retention fixed:T "
                  "(Continuum-style TTL pin, not Continuum's scheduler)"),
    "autellix": "marsched serve --policy autellix (program-level least attained service)",
    "mars": "marsched serve (defaults: policy mars, retention policy, predictor auto)",
    ORACLE: "marsched serve (defaults), every turn's reply length sent as its prediction (a diagnostic)",
}


@dataclass(frozen=True, slots=True)
class Engine:
    """What every server gets alike."""

    model: str
    kv_blocks: int = 40  # --num-gpu-blocks-override (128-token blocks on the CPU): the old bench's size
    max_model_len: int = 4096  # the tiny model's longest context (`marsched model`)
    seed: int = 0
    extra: tuple[str, ...] = ()  # more vLLM options, for every configuration
    marsched_extra: tuple[str, ...] = ()  # more `marsched serve` options, for the marsched configurations


DEFAULT_ENGINE = Engine(model="")


def check_configs(names: Sequence[str]) -> list[str]:
    """The names, checked: known, none twice, at least one; ValueError naming the bad one."""
    if not names:
        raise ValueError(f"--configs: give some of {', '.join(KNOWN)}")
    for name in names:
        if name not in KNOWN:
            raise ValueError(f"--configs: unknown {name!r}; give some of {', '.join(KNOWN)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--configs {','.join(names)}: a configuration is named twice")
    return list(names)


def check_out_folder(out: str) -> None:
    """`--out`, checked before anything runs: a folder files can be written in; ValueError naming it."""
    try:
        check_output_folder(out)
    except OutputPathError as error:
        raise ValueError(f"--out {out}: {error}") from None


def vllm_options(engine: Engine) -> list[str]:
    return ["--max-model-len", str(engine.max_model_len), "--num-gpu-blocks-override", str(engine.kv_blocks),
            "--seed", str(engine.seed), "--enforce-eager", "--enable-prefix-caching",
            "--disable-uvicorn-access-log", *engine.extra]


def host_tier_config() -> dict:
    """`--kv-transfer-config` of `vllm-stock-host`: the tier holds as many tokens as `marsched serve`
    gives the Swap connector."""
    return {"kv_connector": "HostPrefixTierConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "marsched.vllm.prefix_tier",
            "kv_connector_extra_config": {"host_tokens": MarsConfig().host_swap_tokens}}


def server_command(config: str, engine: Engine, port: int, fixed_s: float, meter: Path | None = None) -> list[str]:
    """The argv that starts `config`'s server on `port`; `fixed_s` is continuum's T; `meter`: the
    file a stock server's step meter writes its step costs to (`vllm.step_meter`), or none."""
    stock = [sys.executable, "-m", ENTRY, "--model", engine.model, "--host", "127.0.0.1", "--port", str(port),
             "--logits-processors", PROCESSOR]
    if meter is not None:
        stock += ["--scheduler-cls", METERED_SCHEDULER]
    metered = [f"{METER_ENV}={meter}"] if meter is not None else []
    if config == BASELINE:
        return [*(["env", *metered] if metered else []), *stock, *vllm_options(engine)]
    if config == STOCK_HOST:
        # A KV connector makes vLLM reserve one core more (for NIXL's thread): on two cores the model
        # would compute on both, stock vLLM on one. Reserve what stock does, unless the caller set it.
        reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                  str(stock_reserved_cores(tuple(vllm_options(engine)))))
        return ["env", f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}", *metered, *stock,
                "--kv-transfer-config", json.dumps(host_tier_config(), separators=(",", ":")), *vllm_options(engine)]
    marsched = [sys.executable, "-m", "marsched.cli", "serve", engine.model, "--port", str(port),
                "--seed", str(engine.seed), "--bench-reply-lengths"]
    if config in ("vllm", "infercept", "autellix"):
        marsched += ["--policy", config]
    elif config == "continuum":
        marsched += ["--policy", "mars", "--retention", f"fixed:{fixed_s:g}"]
    elif config not in (FOCUS, ORACLE):
        raise ValueError(f"unknown configuration {config!r}; give {', '.join(KNOWN)}")
    return [*marsched, *engine.marsched_extra, "--", *vllm_options(engine)]


def pin_seconds(sessions: Sequence[Session], gap_scale: float, max_gap_s: float | None) -> float:
    """Continuum's T by the old benchmark's rule (2 x the median tool time), from the workload's gaps
    as replayed (after --gap-scale and --max-gap-s); 1 s where no turn has a next one."""
    gaps = [shape_gap(turn.gap_s, gap_scale, max_gap_s) for s in sessions for turn in s.turns[:-1]]
    median = statistics.median(gaps) if gaps else 0.0
    return round(2 * median, 1) if median > 0 else 1.0
