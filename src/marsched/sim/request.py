"""A request as the simulator holds it: its progress, its phase, where its KV blocks are."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from marsched.metrics.records import RequestRecord
from marsched.policy.cost_model import CostModel
from marsched.policy.progress import RequestProgress
from marsched.policy.strategy import Strategy
from marsched.sim.isolated import isolated_latency
from marsched.sim.link import Transfer


class Phase(str, Enum):
    WAITING = "waiting"  # in the queue, needs prefill (new, preempted or discarded)
    RUNNING = "running"
    PAUSED = "paused"  # inside an API call
    SWAPPED = "swapped"  # call returned, KV in host memory, in the queue for swap-in
    SWAPPING_IN = "swapping-in"
    FINISHED = "finished"


_QUEUE_OF_PHASE = {
    Phase.WAITING: "waiting", Phase.RUNNING: "running", Phase.PAUSED: "paused", Phase.SWAPPED: "swapped",
    Phase.SWAPPING_IN: "running", Phase.FINISHED: "finished",
}


@dataclass(slots=True, eq=False)
class SimRequest:
    progress: RequestProgress
    phase: Phase = Phase.WAITING
    device_blocks: int = 0
    host_blocks: int = 0
    api_end_s: float = math.inf
    transfer: Transfer | None = None
    first_token_s: float = math.nan
    finish_s: float = math.nan
    wait_since_s: float = 0.0
    max_wait_s: float = 0.0
    preemptions: int = 0
    strategies: list[str] = field(default_factory=list)  # the strategy each call ran under
    override: Strategy | None = None  # a strategy the request chose itself (never, in a simulation)
    rid: str = field(init=False)  # the request's id, read many times a step
    # Whose content its KV blocks are, as the prefix cache and host tier know them: its
    # conversation's (the next task's prompt starts with them), else its own.
    kv_owner: str = field(init=False)
    # While it has freed nothing itself, the most leading blocks a hit on `kv_owner` may serve:
    # the blocks its prompt shares with its conversation's previous task. None: no bound (the
    # cached content is its own).
    inherited_blocks: int | None = None

    def __post_init__(self) -> None:
        self.rid = self.progress.request_id
        self.kv_owner = self.progress.request.conversation or self.rid


@dataclass(frozen=True, slots=True)
class SimResult:
    records: list[RequestRecord]
    iterations: int
    steps: int  # scheduling decisions made (identical iterations run together count once)
    end_s: float
    wallclock_s: float
    reused_blocks: int = 0  # blocks taken back from the prefix cache or the host tier instead of computed
    carried_blocks: int = 0  # the part of them a task took from its conversation's previous task
    shared_blocks: int = 0  # the full blocks tasks' prompts share with their conversation's previous task


def finished_record(sim_request: SimRequest, cost: CostModel) -> RequestRecord:
    """The record of a request that finished at `sim_request.finish_s`."""
    request = sim_request.progress.request
    return RequestRecord(
        request_id=request.request_id,
        arrival_s=request.arrival_s,
        first_token_s=sim_request.first_token_s,
        finish_s=sim_request.finish_s,
        api_time_s=request.api_time_s,
        prompt_tokens=request.prompt_tokens,
        output_tokens=request.output_tokens,
        api_return_tokens=request.api_return_tokens,
        preemptions=sim_request.preemptions,
        max_wait_s=sim_request.max_wait_s,
        isolated_e2e_s=isolated_latency(request, cost),
        strategies=tuple(sim_request.strategies),
    )
