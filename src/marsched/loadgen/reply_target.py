"""The reply length a load generator asks for: its key in `vllm_xargs`, and what a valid value is.

`marsched loadgen` replays traces whose replies have known lengths. It sends each turn's
length as ``"vllm_xargs": {"marsched_bench_reply_tokens": N}``, a key of its own beside (never
inside) ``vllm_xargs.marsched``, the scheduler's metadata: the scheduler reads only
``extra_args["marsched"]`` (`marsched.vllm.metadata.decode`), so the length never reaches a
policy. Only the bench's logits processor (`marsched.loadgen.reply_length`) reads it.

This module does not import vllm or torch: the client and the front end both use it.
"""

from __future__ import annotations

from typing import Any

REPLY_TOKENS_KEY = "marsched_bench_reply_tokens"
MAX_REPLY_TOKENS = 10_000_000  # far beyond any context; keeps the value a plain int32


def check_reply_target(value: Any) -> int:
    """The target as an int (tokens the reply has, its end-of-sequence token included), or ValueError
    naming the field."""
    if type(value) is not int:  # bool is not a count, 3.0 is not either
        raise ValueError(f"vllm_xargs.{REPLY_TOKENS_KEY}: must be an integer, got {value!r}")
    if not 1 <= value <= MAX_REPLY_TOKENS:
        raise ValueError(f"vllm_xargs.{REPLY_TOKENS_KEY}: must be between 1 and {MAX_REPLY_TOKENS}, got {value}")
    return value


def reply_target(extra_args: dict[str, Any] | None) -> int | None:
    """The checked target of a request's `SamplingParams.extra_args`; None when it has none."""
    if not extra_args or REPLY_TOKENS_KEY not in extra_args:
        return None
    return check_reply_target(extra_args[REPLY_TOKENS_KEY])
