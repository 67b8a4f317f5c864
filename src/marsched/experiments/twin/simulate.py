"""The simulated side: one configuration at one load, on the engine the live servers run.

The profile is `marsched calibrate`'s for this engine and model shape; its KV capacity, batch
bounds and host swap space are set to what every live server gets (`--num-gpu-blocks-override`,
`--max-num-seqs`, `--max-num-batched-tokens`, the plugin's host swap budget), so that the
simulated engine is the live one as far as the profile can say.

Loadgen runs each task's tools itself, so every turn after a call reaches the server as a new
request: the simulator queues a follow-up whose KV was kept on the device as it queues any turn
(`Simulator(queued_turns=True)`), where a resumable request inside vLLM would rejoin the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from marsched.experiments.twin.configs import twin_policy
from marsched.experiments.twin.served_costs import with_served_terms
from marsched.loadgen.options import LoadgenOptions
from marsched.metrics.records import summarize
from marsched.sim.profile import Profile, load_profile
from marsched.sim.select import make_simulator
from marsched.vllm.config import MarsConfig
from marsched.workload.model import Request

REPORTED = ("e2e_mean_s", "e2e_p50_s", "e2e_p99_s", "isolated_e2e_mean_s", "ttft_mean_s", "max_queue_wait_s", "num_finished",
            "preemptions", "strategy_counts")


@dataclass(frozen=True, slots=True)
class SimEngine:
    """What the simulated engine shares with the live servers."""

    profile: str  # a profile JSON path (`marsched calibrate --out`) or a bundled name
    kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int


def engine_profile(engine: SimEngine) -> Profile:
    """The profile with the live engine's capacity and bounds."""
    profile = load_profile(engine.profile)
    host_blocks = MarsConfig().host_swap_tokens // profile.block_tokens
    return replace(profile, device_blocks=engine.kv_blocks, host_blocks=host_blocks,
                   max_sequences=engine.max_num_seqs,
                   cost=replace(profile.cost, token_budget=engine.max_num_batched_tokens))


def simulate(config: str, load: LoadgenOptions, engine: SimEngine, pin_s: float,
             requests: list[Request], served: dict[str, Any] | None = None) -> dict[str, Any]:
    """The simulator's per-task summary for `config` on `load`'s replay, `requests`
    (`stream.replayed_requests`, built once per load and shared by the configurations); `served`:
    the step costs the live servers learned (`served_costs.served_terms`), in place of the profile's."""
    profile = engine_profile(engine)
    if served is not None:
        profile = replace(profile, cost=with_served_terms(profile.cost, served))
    if not requests:
        raise ValueError(f"no task arrives at --rate {load.rate:g} in --duration {load.duration_s:g} s")
    policy = twin_policy(config, profile.cost, pin_s, load.seed)
    # Every turn after a tool call is a new HTTP request: a follow-up whose KV was kept queues like any.
    result = make_simulator(requests, profile, policy, queued_turns=True).run()
    summary = summarize(result.records)
    return {key: summary[key] for key in REPORTED} | {"tasks": len(requests)}
