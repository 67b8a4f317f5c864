"""A bench-only vLLM logits processor: a reply ends exactly at the length the load generator asks for.

A trace replay must produce the trace's reply lengths, and it must do so without telling
the scheduler: a scheduler that saw the length would be an oracle. So the length travels in
``vllm_xargs.marsched_bench_reply_tokens`` (`marsched.loadgen.reply_target`), which no
scheduler reads, and this processor, which runs in the model runner after the scheduler has
decided, enforces it on the logits:

- before the target, every stop token of the request (its EOS, and the model's other
  end-of-sequence ids) is set to -inf, so the reply cannot end early;
- at the target (the target-th token), every logit but EOS's is set to -inf, so the reply
  ends there, with finish reason ``stop``. `usage.completion_tokens` is then the target:
  vLLM counts the EOS token it stops on.

A request without the key is left alone. The client's ``max_tokens`` stays a fixed cap (vLLM
still ends a reply at it, or at the context's end, first). No ``ignore_eos``: a request that
has it has no EOS to force and is left alone too.

Load it next to the validator:

    marsched serve MODEL --bench-reply-lengths
    python -m vllm.entrypoints.openai.api_server --model MODEL \
        --logits-processors marsched.loadgen.reply_length:BenchReplyLength

Like `marsched.vllm.validate.MarsRequestValidator` it implements both of vLLM's interfaces,
because which one vLLM loads depends on the model runner: V1 (`vllm.v1.sample.logits_processor`:
the CPU, and GPUs without Triton; tested here on the CPU) and V2
(`vllm.v1.worker.gpu.sample.logits_processor`: GPUs by default). Both compute the masks with
`force_reply_lengths`, one tensor operation per step over the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor, MoveDirectionality

from marsched.loadgen.reply_target import REPLY_TOKENS_KEY, reply_target

try:  # the V2 model runner's interface (import-light, but absent from older layouts)
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # pragma: no cover - vLLM 0.32 has it
    V2LogitsProcessor = object  # type: ignore[misc,assignment]

PROCESSOR = f"{__name__}:BenchReplyLength"
MAX_STOP_IDS = 8  # per request: EOS and the model's other end ids (Llama 3 has three)


def move_rows(rows: dict[int, Any], moved: Any) -> None:
    """Follow vLLM's batch moves (`BatchUpdate.moved`: from, to, direction) in a per-row dict."""
    for a, b, direction in moved:
        a_row, b_row = rows.pop(a, None), rows.pop(b, None)
        if a_row is not None:
            rows[b] = a_row
        if b_row is not None and direction == MoveDirectionality.SWAP:
            rows[a] = b_row


def stop_ids(sampling_params: Any) -> tuple[int, ...]:
    """The request's stop token ids, the one to force first: its EOS, else its lowest stop id; () when
    it has none (e.g. `ignore_eos`), and then nothing can be forced."""
    eos = getattr(sampling_params, "eos_token_id", None)
    others = sorted(set(getattr(sampling_params, "all_stop_token_ids", ()) or ()) - {eos})
    ids = ([eos] if eos is not None else []) + others
    return tuple(ids[:MAX_STOP_IDS])


def force_reply_lengths(logits: torch.Tensor, targets: torch.Tensor, generated: torch.Tensor,
                        stops: torch.Tensor) -> None:
    """Edit `logits` in place. Per row: `targets` (tokens the reply must have; <= 0: leave the row
    alone), `generated` (tokens it has before this one), `stops` (its stop ids, the one to force
    first; pad with repeats)."""
    active = targets > 0
    last = active & (generated + 1 >= targets)  # this token is the target-th: it must be EOS
    early = active & ~last
    stop_mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, stops, True)
    logits.masked_fill_(stop_mask & early[:, None], float("-inf"))
    eos_mask = torch.zeros_like(stop_mask).scatter_(1, stops[:, :1], True)
    logits.masked_fill_(last[:, None] & ~eos_mask, float("-inf"))
    logits.masked_fill_(last[:, None] & eos_mask, 0.0)  # finite even if a grammar had masked it


def _padded(ids: tuple[int, ...]) -> list[int]:
    return list(ids) + [ids[0]] * (MAX_STOP_IDS - len(ids))


class BenchReplyLength(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        second = args[0] if args else kwargs.get("device", kwargs.get("req_states"))
        self._v2 = second is not None and not isinstance(second, (torch.device, str))
        # V1: batch row -> (target, the request's live list of output ids, its stop ids)
        self._rows: dict[int, tuple[int, list[int], tuple[int, ...]]] = {}
        if self._v2:
            self._req_states = second
            self._device = second.device
            size = second.max_num_reqs
            self._targets = np.zeros(size, dtype=np.int64)  # per request slot; 0: none
            self._stops = np.zeros((size, MAX_STOP_IDS), dtype=np.int64)
            self._dirty = True
            self._targets_device = self._stops_device = None

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """In the front end: a bad target is an HTTP 400 naming the field."""
        try:
            reply_target(getattr(sampling_params, "extra_args", None))
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter=f"vllm_xargs.{REPLY_TOKENS_KEY}") from None

    # --- V1 interface ------------------------------------------------------------------

    def is_argmax_invariant(self) -> bool:
        return False  # it decides where greedy decoding ends

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            target, ids = _target_of(params), stop_ids(params)
            if target is not None and ids:
                self._rows[index] = (target, output_ids, ids)
            else:
                self._rows.pop(index, None)
        move_rows(self._rows, batch_update.moved)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if self._v2:
            return self._apply_v2(logits, ctx)
        if not self._rows:
            return logits
        rows = logits.shape[0]
        targets, generated = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        stops = np.zeros((rows, MAX_STOP_IDS), dtype=np.int64)
        for index, (target, output_ids, ids) in self._rows.items():
            if index < rows:
                targets[index], generated[index], stops[index] = target, len(output_ids), _padded(ids)
        force_reply_lengths(logits, *(torch.from_numpy(a).to(logits.device) for a in (targets, generated, stops)))
        return logits

    # --- V2 interface ------------------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        target, ids = _target_of(sampling_params), stop_ids(sampling_params)
        active = target is not None and bool(ids)
        self._targets[req_idx] = target if active else 0
        if active:
            self._stops[req_idx] = _padded(ids)
        self._dirty = True
        return active

    def apply_staged_writes(self) -> None:
        if self._dirty:
            self._targets_device = torch.from_numpy(self._targets).to(self._device)
            self._stops_device = torch.from_numpy(self._stops).to(self._device)
            self._dirty = False

    def _apply_v2(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not np.any(self._targets[ctx.idx_mapping_np] > 0):  # on the host: no device sync
            return logits
        slots = ctx.expanded_idx_mapping.long()
        prompt_len = self._req_states.prompt_len.gpu[slots].long()
        generated = ctx.pos.long() + 1 - prompt_len  # the row's input is token pos; the next is pos + 1
        force_reply_lengths(logits, self._targets_device[slots], generated, self._stops_device[slots])
        return logits


def _target_of(sampling_params: Any) -> int | None:
    try:
        return reply_target(getattr(sampling_params, "extra_args", None))
    except ValueError:  # the front end refused it already; a Python API caller gets no forcing
        return None
