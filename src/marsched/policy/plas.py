"""Autellix's PLAS order (arXiv 2502.13965, §4.2): least attained service per program, in
multi-level queues.

A program is a request of several LLM calls (its segments). Its attained service is the
engine time its completed calls received (Eq. 1), counted here in scheduling iterations, as
the third-party plugin kungfu-team/autellix counts it (one per step a call is scheduled in;
`vllm/v1/core/sched/autellix/attained_service.py`). A new call joins the queue whose range
holds its program's service (Alg. 1, lines 12-13); a call whose own service outgrows its
queue's quantum moves one queue down (lines 20-22); within a queue, first come first served
by the call's arrival. The paper gives no numbers for the queues; these are the plugin's
(`policy_core.py`): seven queues, bounds 2, 4, ..., 64 iterations, quanta 1, 2, ..., 64.
Its anti-starvation rule (lines 24-30: a call whose waiting over its service reaches β goes
to the first queue) is the starvation variant `autellix` (β = 8, the plugin's).
"""

from __future__ import annotations

import bisect

LEVEL_BOUNDS = (2, 4, 8, 16, 32, 64)  # attained iterations at which the next queue starts
QUANTA = (1, 2, 4, 8, 16, 32, 64)  # iterations a call may run in each queue before it moves down
STARVATION_RATIO = 8.0  # β
# A queue key is level × this plus the call's arrival (s): every level's arrivals sort inside it.
LEVEL_SPAN_S = 1e9


def level_of(program_service: int, call_service: int) -> int:
    """The queue (0 first) of a call whose program had `program_service` iterations before it and
    which has run `call_service` itself."""
    level = bisect.bisect_right(LEVEL_BOUNDS, program_service)
    left = call_service
    while level < len(QUANTA) - 1 and left >= QUANTA[level]:
        left -= QUANTA[level]
        level += 1
    return level


def plas_key(program_service: int, call_service: int, call_arrival_s: float) -> float:
    """Lower runs first: the call's queue, then its arrival."""
    return level_of(program_service, call_service) * LEVEL_SPAN_S + call_arrival_s
