"""A request's length prediction, told to the scheduler after the request: the API server
forwards each request at once and predicts alongside (`marsched.serve.prediction`), so no
request waits for its prediction.

The number follows on vLLM's abort path, as a conversation's release does
(`retention.send_release`), in one id:

    marsched-predicted:<rid>\\x1f<tokens>

<rid> is the request's `vllm_xargs.marsched.rid` (it may hold anything, so the number comes
after the last `\\x1f`); <tokens> is an integer of 1 to `metadata.MAX_TOKENS`. The message
races the request to the engine core, since vLLM's front end renders and tokenizes the request
meanwhile:

- it comes first: it waits here (`EARLY_KEPT` at most, the oldest forgotten first) and the
  request takes it on arrival, as if it had carried `predicted`;
- it comes while the request waits, never admitted: the scheduler predicts its segment again and
  ranks it anew (`CallSteps._told_prediction`);
- it comes once the request was admitted: it can order nothing, and is counted as late.

Under data parallelism it goes to every rank, as a release does; the ranks that never see the
request forget it with the oldest. This module does not import vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from marsched.vllm.metadata import MAX_RID_CHARS, MAX_TOKENS

PREDICTED_PREFIX = "marsched-predicted:"
SEPARATOR = "\x1f"  # ASCII unit separator: between the request's rid and the number
EARLY_KEPT = 10_000  # numbers that came before their request, kept for it


def prediction_id(rid: str, tokens: int) -> str | None:
    """The abort-path id telling that request `rid`'s reply is predicted at `tokens`; None if
    either is out of what the metadata allows."""
    if not 1 <= len(rid) <= MAX_RID_CHARS or isinstance(tokens, bool) or not 1 <= tokens <= MAX_TOKENS:
        return None
    return f"{PREDICTED_PREFIX}{rid}{SEPARATOR}{tokens}"


def read_prediction(text: str) -> tuple[str, int] | None:
    """(rid, tokens) from what follows PREDICTED_PREFIX in an id; None if malformed."""
    rid, separator, number = text.rpartition(SEPARATOR)
    if not separator or not 1 <= len(rid) <= MAX_RID_CHARS or not number.isascii() or not number.isdigit():
        return None
    tokens = int(number)
    return (rid, tokens) if 1 <= tokens <= MAX_TOKENS else None


async def send_prediction(engine_client: Any, rid: str, tokens: int) -> bool:
    """From the API server: tell the engine core that request `rid`'s reply is predicted at
    `tokens`. Sent to every data-parallel rank; False if there was nothing to send."""
    from marsched.vllm.abort_routing import send_to_every_rank

    told = prediction_id(rid, tokens)
    if told is None:
        return False
    await send_to_every_rank(engine_client.engine_core, [told])
    return True


class ToldPredictions:
    """The scheduler's side: requests that may still be told their number, and numbers told early."""

    def __init__(self, early_kept: int = EARLY_KEPT) -> None:
        self.early_kept = early_kept
        self._early: OrderedDict[str, int] = OrderedDict()
        self._expecting: dict[str, str] = {}  # rid -> vLLM's id, for requests that arrived without a number
        self.on_arrival = 0  # told before their request, taken on arrival
        self.while_waiting = 0  # told while their request waited: ranked anew
        self.late = 0  # told after their request was admitted (one that ended waits as an early number)

    def take(self, rid: str | None) -> int | None:
        """A request named `rid` arrives without a number: the one told before it, if any."""
        if rid is None:
            return None
        tokens = self._early.pop(rid, None)
        if tokens is not None:
            self.on_arrival += 1
        return tokens

    def expect(self, rid: str, internal: str) -> None:
        """It arrived without a number: one may follow."""
        self._expecting[rid] = internal

    def told(self, rid: str, tokens: int) -> str | None:
        """A number for `rid`: vLLM's id of the request expecting it, else None (kept for its arrival)."""
        internal = self._expecting.pop(rid, None)
        if internal is None:
            self._early[rid] = tokens
            self._early.move_to_end(rid)
            while len(self._early) > self.early_kept:
                self._early.popitem(last=False)
        return internal

    def forget(self, rid: str, internal: str) -> None:
        """Request `internal` (named `rid`) ended: it expects nothing more."""
        if self._expecting.get(rid) == internal:
            del self._expecting[rid]

    def snapshot(self) -> dict[str, int]:
        return {"predictions_told_on_arrival": self.on_arrival, "predictions_told_while_waiting": self.while_waiting,
                "predictions_told_late": self.late}
