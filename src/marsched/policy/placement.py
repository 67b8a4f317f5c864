"""Which replica (a data-parallel rank, a server) a new conversation goes to: the placement
rules, as pure functions, for `marsched serve`'s ranks (`serve/affinity.py`) and the simulated
cluster (`sim/cluster.py`).

A conversation's later turns go where its first turn went; these rules choose the replica of a
first turn from what each reported at the last look (`RankLoad`, its scheduler's state) and
what was placed on it since:

- `mars`: the least predicted KV memory × time in flight, the MARS ranking key summed over the
  rank's requests (`marsched_predicted_memory_time_in_flight`). A turn placed since the last
  look counts as the mean key of a tracked request.
- `least-loaded`: vLLM's own data-parallel balancer (`DPLBAsyncMPClient.get_core_engine_for_request`
  in `vllm/v1/engine/core_client.py`): the greater of this front end's requests in flight and
  the rank's waiting + running, plus `waiting × 6 × max(0, KV usage − 0.5)`; a turn placed since
  the last look counts as one more waiting, as vLLM counts it between its coordinator's reports.
- `hash`: a hash of the conversation id, for several API server processes, which share no
  state: each computes the same rank, so affinity holds, but no load is seen.

Ties go to the first rank from a start that moves by one at every placement (vLLM does the
same), so that an idle server spreads conversations round-robin.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence
from dataclasses import dataclass


class Placement(enum.Enum):
    MARS = "mars"
    LEAST_LOADED = "least-loaded"
    HASH = "hash"
    OFF = "off"  # no affinity: vLLM's balancer places every turn anew


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's scheduler state at the last look."""

    memory_time: float = 0.0  # predicted token-seconds its requests will still hold
    tracked: int = 0  # requests its scheduler holds
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction of its device blocks in use

    @classmethod
    def from_state(cls, scheduler: dict) -> RankLoad:
        def number(key: str) -> float:
            value = scheduler.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

        return cls(number("memory_time_in_flight"), int(number("tracked")), int(number("waiting")),
                   int(number("running")), number("device_usage"))


def mars_scores(loads: Sequence[RankLoad], placed_since: Sequence[int]) -> list[float]:
    tracked = sum(load.tracked for load in loads)
    mean_key = sum(load.memory_time for load in loads) / tracked if tracked else 1.0
    return [load.memory_time + placed * mean_key for load, placed in zip(loads, placed_since)]


def least_loaded_scores(loads: Sequence[RankLoad], placed_since: Sequence[int],
                        in_flight: Sequence[int]) -> list[float]:
    scores = []
    for load, placed, ours in zip(loads, placed_since, in_flight):
        waiting = load.waiting + placed
        score = float(max(ours, waiting + load.running))
        if waiting:
            score += waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
        scores.append(score)
    return scores


def lowest(scores: Sequence[float], start: int) -> int:
    """The index of the lowest score, ties to the first from `start` on (wrapping)."""
    n = len(scores)
    best = start % n
    for step in range(1, n):
        index = (start + step) % n
        if scores[index] < scores[best]:
            best = index
    return best


def hashed_rank(conversation: str, ranks: int) -> int:
    return zlib.crc32(conversation.encode("utf-8", "surrogatepass")) % ranks
