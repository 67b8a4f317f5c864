"""What survives a call that compacts the context (`ApiCall.kept_tokens`): one rule for the
simulator and for the policy's formulas (waste, ranking), so that what the policy predicts a
call leaves is what the engine then holds.

A compacting call keeps a prefix of the context at the call; the KV beyond it is of no use
afterwards (freed under Preserve, not swapped back under Swap), and under Discard only the kept
prefix is recomputed. A call that keeps everything (`kept_tokens` None) leaves the formulas as
they were.
"""

from __future__ import annotations


def kept_context(context_at_call: int, kept_tokens: int | None) -> int:
    """Tokens of the context at the call that the next segment keeps as its prefix."""
    return context_at_call if kept_tokens is None else min(kept_tokens, context_at_call)


def next_context(context_at_call: int, kept_tokens: int | None, return_tokens: int) -> int:
    """The next segment's context: the kept prefix and the call's return (`ApiCall.next_context`)."""
    return kept_context(context_at_call, kept_tokens) + return_tokens


def cached_after_call(cached_tokens: int, kept_tokens: int | None, next_context_tokens: int) -> int:
    """KV tokens still of use when the call returns, of `cached_tokens` cached at the call.

    Those of the kept prefix, and never the whole next context: the next token is sampled from
    the last one computed, so, as vLLM does on a full prefix hit, that one is computed again
    (a compaction with no return would otherwise leave nothing to compute).
    """
    kept = cached_tokens if kept_tokens is None else min(cached_tokens, kept_tokens)
    return max(min(kept, next_context_tokens - 1), 0)
