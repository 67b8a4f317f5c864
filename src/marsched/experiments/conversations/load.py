"""The load of the conversation benchmark: conversations drawn once from a seed, the same for every server.

Conversations arrive as a Poisson process; each sends a long prompt of random vocabulary
words, then k tool turns (the client sleeps the tool time, lognormal with median
`tool_median_s`, and sends the follow-up with the tool's result appended), then a final
answer turn. Every turn carries `vllm_xargs.marsched` = {"conversation": id, "tool_s": the
client's estimate (the distribution's median)}, the last one `retain: false` instead
(`marsched_xargs`); `conversation_keys=False` leaves them out.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Load:
    """What the clients send; drawn from `seed` so every configuration gets the same conversations."""

    rate: float = 0.5  # conversations per second (Poisson); 0.8 with 1536-token prompts overloaded 2 busy cores
    duration_s: float = 150.0  # arrivals stop here; the run waits for every conversation to end
    prompt_tokens: int = 1024  # the small model's prefill jumps past 1,024 tokens
    tool_turns: int = 3
    tool_median_s: float = 1.5
    tool_sigma: float = 0.6  # of the lognormal's log
    result_tokens: int = 48  # the tool's result, appended to the follow-up
    answer_tokens: int = 32
    seed: int = 0
    conversation_keys: bool = True


@dataclass(frozen=True, slots=True)
class Conversation:
    cid: str
    arrival_s: float  # since the start of the load
    prompt: str
    tool_s: tuple[float, ...]  # one per tool turn
    results: tuple[str, ...]


DEFAULT_LOAD = Load()  # a slotted dataclass has no class-level defaults to read


def vocabulary_words(model: str) -> list[str]:
    """Words that are one token of the model's tokenizer with a space before them: n words ~ n tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    words = []
    for token, token_id in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if token_id not in special and text.startswith(" ") and text[1:].isalpha() and text[1:].isascii():
            words.append(text[1:])
    words = sorted(set(words))
    if len(words) < 50:
        raise SystemExit(f"{model}: its tokenizer has only {len(words)} plain words; give a model with a real vocabulary")
    return words


def draw_load(load: Load, words: list[str]) -> list[Conversation]:
    rng = random.Random(load.seed)
    conversations, t = [], 0.0
    while True:
        t += rng.expovariate(load.rate)
        if t >= load.duration_s:
            break
        index = len(conversations)
        prompt = " ".join(rng.choice(words) for _ in range(load.prompt_tokens))
        tool_s = tuple(rng.lognormvariate(math.log(load.tool_median_s), load.tool_sigma) for _ in range(load.tool_turns))
        results = tuple(" ".join(rng.choice(words) for _ in range(load.result_tokens)) for _ in range(load.tool_turns))
        conversations.append(Conversation(f"conv-{load.seed}-{index}", round(t, 4), prompt, tool_s, results))
    return conversations


def marsched_xargs(load: Load, cid: str, last: bool) -> dict[str, Any] | None:
    if not load.conversation_keys:
        return None
    fields: dict[str, Any] = {"conversation": cid}
    if last:
        fields["retain"] = False
    else:
        fields["tool_s"] = load.tool_median_s  # the client's estimate, not the draw
    return {"marsched": json.dumps(fields, separators=(",", ":"))}
