"""A request's latency alone on the engine: the floor no scheduler can beat."""

from __future__ import annotations

from marsched.policy.cost_model import CostModel
from marsched.workload.model import Request


def isolated_latency(request: Request, cost: CostModel) -> float:
    """Prefill in budget-sized chunks, one token per decode iteration, every call waited for.

    After a call, the last token sampled before it and the call's return are prefilled on the
    context kept from before the call (alone on the engine, nothing forces it out).
    """
    total = 0.0
    previous_return = 0
    for index, segment in enumerate(request.segments):
        prefill = segment.context_tokens if index == 0 else previous_return + 1
        computed = segment.context_tokens - prefill
        total += cost.prefill_time(prefill, computed)
        # The prefill samples the first token; each later one is a decode step reading the
        # whole context, which starts at the segment's context plus that first token.
        total += cost.decode_time(segment.context_tokens + 1, segment.output_tokens - 1)
        if segment.api is not None:
            total += segment.api.duration_s
            previous_return = segment.api.return_tokens
    return total
