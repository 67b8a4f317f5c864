"""A bench-only vLLM logits processor: every reply is a given text, chosen by the turn (the sibling
of `marsched.loadgen.reply_length`).

A random-weight model never calls a tool on its own, so an unmodified agent client (Claude Code,
Codex) pointed at it never runs a tool loop. With this processor loaded, the model writes a script
instead: the first turn's reply (say, a call of the Bash tool running ``ls`` in the model's
tool-call syntax), then, once the prompt holds that call's result, the next (an answer), each
ended by EOS. The client sees a real tool call, runs the tool and sends the follow-up, unchanged.

The script is a JSON file named by the environment variable ``MARSCHED_SCRIPTED_REPLIES``:

    {"turn_marker": "<tool> ", "replies": ["[Bash(command='ls')]", "The files are listed above."]}

A request's turn is how many times ``turn_marker`` (the text the chat template writes before a
tool result) occurs in its decoded prompt; it gets ``replies[turn]``, the last reply for every
later turn. The processor runs in the model runner after the scheduler has decided, and nothing of
the script reaches the scheduler or the request: no scheduler input changes.

Load it with vLLM's flag (after ``--`` on `marsched serve`), the script in the environment:

    MARSCHED_SCRIPTED_REPLIES=script.json marsched serve MODEL -- \\
        --logits-processors marsched.loadgen.scripted_reply:ScriptedReply

Only vLLM's V1 logits-processor interface (the model runner of the CPU backend) is implemented.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from marsched.loadgen.reply_length import move_rows, stop_ids

SCRIPT_ENV = "MARSCHED_SCRIPTED_REPLIES"
PROCESSOR = f"{__name__}:ScriptedReply"


@dataclass(frozen=True)
class Script:
    turn_marker: str
    replies: tuple[str, ...]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Script":
        try:
            data = json.loads(Path(path).read_text())
            script = cls(str(data["turn_marker"]), tuple(str(r) for r in data["replies"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a script of replies ({SCRIPT_ENV}): {error}") from None
        if not script.turn_marker or not script.replies:
            raise ValueError(f"{path}: turn_marker and replies must not be empty ({SCRIPT_ENV})")
        return script

    def reply_for(self, prompt_text: str) -> int:
        """The index of the reply a prompt gets: the tool results it holds, capped at the last."""
        return min(prompt_text.count(self.turn_marker), len(self.replies) - 1)


def force_tokens(logits: torch.Tensor, row: int, token: int) -> None:
    """Edit `logits` in place: row `row` can only sample `token`."""
    logits[row].fill_(float("-inf"))
    logits[row, token] = 0.0


class ScriptedReply(LogitsProcessor):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        path = os.environ.get(SCRIPT_ENV)
        if not path:
            raise ValueError(f"{PROCESSOR} needs {SCRIPT_ENV}: the path of a JSON script of replies")
        self.script = Script.load(path)
        model = vllm_config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
        self.reply_ids = [self.tokenizer.encode(reply, add_special_tokens=False) for reply in self.script.replies]
        self._rows: dict[int, tuple[list[int], list[int], int]] = {}  # row -> (reply ids, live output ids, EOS)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            ends = stop_ids(params)
            if not ends or prompt_ids is None:
                self._rows.pop(index, None)
                continue
            turn = self.script.reply_for(self.tokenizer.decode(prompt_ids))
            self._rows[index] = (self.reply_ids[turn], output_ids, ends[0])
        move_rows(self._rows, batch_update.moved)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        for index, (reply, output_ids, eos) in self._rows.items():
            if index < logits.shape[0]:
                written = len(output_ids)
                force_tokens(logits, index, reply[written] if written < len(reply) else eos)
        return logits
