"""A request's latency alone on the engine: the floor no scheduler can beat."""

from __future__ import annotations

from marsched.policy.compaction import cached_after_call
from marsched.policy.cost_model import CostModel
from marsched.workload.model import Request


def isolated_latency(request: Request, cost: CostModel) -> float:
    """Prefill in budget-sized chunks, one token per decode iteration, every call waited for.

    After a call, the last token sampled before it and the call's return are prefilled on the
    context kept from before the call (alone on the engine, nothing forces it out); after a call
    that compacts the context, its return on the kept prefix (`compaction.cached_after_call`).
    """
    total = 0.0
    cached = 0
    for segment in request.segments:
        total += cost.prefill_time(segment.context_tokens - cached, cached)
        # The prefill samples the first token; each later one is a decode step reading the
        # whole context, which starts at the segment's context plus that first token.
        total += cost.decode_time(segment.context_tokens + 1, segment.output_tokens - 1)
        if segment.api is not None:
            total += segment.api.duration_s
            # All but the last token sampled is cached at the call.
            cached = cached_after_call(segment.context_at_call - 1, segment.api.kept_tokens,
                                       segment.api.next_context(segment.context_at_call))
    return total
