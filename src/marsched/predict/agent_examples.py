"""Training and evaluation examples from agent turns: the bundled agent-text sessions.

The sessions are `marsched.loadgen.agent_text`'s (the LMCache/lmcache-agent-trace data,
commit 16a14ad, Apache-2.0; provenance in ``marsched/loadgen/data/README.md``): 20
mini-swe-agent sessions (``miniswe``, 402 turns) and 25 multi-agent sessions (``magagent``,
746 turns). Their order, keys, prompts and reply lengths are the loader's (`load_agent_text`);
this module only reads the replies' text beside them (`reply_texts`), for `newest_text`.

**One example per turn**, with what a server has when the turn arrives over HTTP:

- *text*: `newest_text` — what the prompt adds over the session's previous prompt and reply
  (the tool's result, the next instruction), of which the encoder reads the first `MAX_CHARS`;
  for a session's first turn, or a prompt that adds nothing, the prompt's last `TAIL_CHARS`
  characters (the end of a prompt is its newest instruction). The serving front end
  (`marsched.serve.turn_text`) reads the same parts, finding the end of the previous prompt
  and reply by their lengths.
- *context tokens*: the whole prompt's GPT-2 tokens (`marsched.workload.tokenizer`).
- *previous reply*: the GPT-2 tokens of the session's previous reply (the loader's reply
  length); 0 for the first turn. Never another session's.
- *target*: the reply's GPT-2 tokens (the loader's, at least 1).

**Turn type** (`api_type` of the example, what the per-type mean baseline groups by): the
family and whether the turn is its session's first (``miniswe:first``, ``magagent:follow-up``).

**Split** (`split_sessions`): by session, per family. In each family the sessions are ordered
by a hash of (seed, key) and the first `round(fraction × count)` are held out: with the
default 0.3, 6 of 20 miniswe and 8 of 25 magagent sessions. Fixed for a seed, independent of
the file order, both families on both sides, no session on both. **Folds** (`session_folds`,
for cross-validation inside the training sessions): the same order, session i of a family in
fold i mod k.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Sequence
from importlib.resources import files

from marsched.loadgen.agent_text import SETS, bundled_file, load_agent_text, reply_cut
from marsched.predict.encoder import MAX_CHARS
from marsched.predict.examples import Example
from marsched.workload.tokenizer import count_tokens_batch

AGENT_TEXT = "agent-text"  # the data's name in `marsched predictor --data`
FAMILIES = SETS
HELD_OUT = 0.3
TAIL_CHARS = MAX_CHARS
FIRST, FOLLOW_UP = "first", "follow-up"


def newest_text(prompt: str, previous_prompt: str | None = None, previous_reply: str = "") -> str:
    """What `prompt` adds over the previous turn's prompt and reply.

    The part after the longest common prefix with the previous prompt followed by its reply; if
    the previous reply appears in that part (another agent's prompt quoting it), what follows
    it. For a first turn (`previous_prompt` None), or when nothing is added: the prompt's last
    TAIL_CHARS characters.
    """
    if previous_prompt is not None:
        new = prompt[len(os.path.commonprefix([prompt, previous_prompt + previous_reply])):]
        reply = previous_reply.strip()
        at = new.find(reply) if reply else -1
        if at >= 0:
            new = new[at + len(reply):]
        if new.strip():
            return new
    return prompt[-TAIL_CHARS:]


def turn_type(family: str, index: int) -> str:
    return f"{family}:{FIRST if index == 0 else FOLLOW_UP}"


def reply_texts(family: str) -> dict[str, list[str]]:
    """Session key -> its replies' text, in the loader's order (timestamp, then line)."""
    resource = files("marsched.loadgen") / "data" / bundled_file(family)
    rows: dict[str, list[tuple[int, int, str]]] = {}
    for number, line in enumerate(gzip.decompress(resource.read_bytes()).decode("utf-8").splitlines(), start=1):
        if line.strip():
            record = json.loads(line)
            rows.setdefault(f"{family}:{record['session_id']}", []).append(
                (record["timestamp"], number, record["output"]))
    return {key: [text for *_, text in sorted(calls)] for key, calls in rows.items()}


def agent_examples(families: Sequence[str] = FAMILIES, turn_chars: int = 0,
                   reply_chars: int | None = None) -> list[Example]:
    """One example per turn of the bundled sessions of `families`, sessions in file order; with
    `turn_chars` (and `reply_chars`), as `marsched loadgen` replays them with the same cuts."""
    turns: list[tuple[str, str, int, str, int, int]] = []  # family, key, index, text, previous reply, reply
    prompts: list[str] = []
    for family in families:
        replies = reply_texts(family)
        keep = reply_cut(turn_chars, reply_chars)
        for session in load_agent_text([family], turn_chars, reply_chars):
            texts = [text[:keep] if keep else text for text in replies.get(session.key, [])]
            if len(texts) != len(session.turns):
                raise ValueError(f"{session.key}: {len(texts)} replies for {len(session.turns)} turns")
            previous_prompt, previous_reply, previous_tokens = None, "", 0
            for index, turn in enumerate(session.turns):
                prompt = turn.prompt.text
                turns.append((family, session.key, index, newest_text(prompt, previous_prompt, previous_reply),
                              previous_tokens, turn.reply_tokens))
                prompts.append(prompt)
                previous_prompt, previous_reply, previous_tokens = prompt, texts[index], turn.reply_tokens
    context = count_tokens_batch(prompts)
    newest = count_tokens_batch([t[3] for t in turns])
    return [Example(family, key, text, newest[i], context[i], turn_type(family, index), reply, previous)
            for i, (family, key, index, text, previous, reply) in enumerate(turns)]


def _rank(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()


def _ordered(keys: Sequence[str], families: Sequence[str], family: str, seed: int) -> list[str]:
    return sorted({k for k, f in zip(keys, families) if f == family}, key=lambda k: _rank(seed, k))


def held_out_sessions(keys: Sequence[str], families: Sequence[str], seed: int, fraction: float) -> set[str]:
    """The held-out session keys: per family, the first round(fraction × count) by hash of (seed, key)."""
    held: set[str] = set()
    for family in sorted(set(families)):
        members = _ordered(keys, families, family, seed)
        held.update(members[:round(fraction * len(members))])
    return held


def session_folds(examples: Sequence[Example], seed: int, folds: int) -> list[int]:
    """Each example's fold (0 to folds - 1): per family, the sessions by hash of (seed, key), dealt in turn."""
    keys, families = [e.group for e in examples], [e.source for e in examples]
    fold_of = {}
    for family in sorted(set(families)):
        fold_of.update({key: index % folds for index, key in enumerate(_ordered(keys, families, family, seed))})
    return [fold_of[e.group] for e in examples]


def split_sessions(examples: Sequence[Example], seed: int = 0,
                   fraction: float = HELD_OUT) -> tuple[list[Example], list[Example]]:
    """(train, held-out), by session, per family (the module's docstring says how)."""
    held = held_out_sessions([e.group for e in examples], [e.source for e in examples], seed, fraction)
    train = [e for e in examples if e.group not in held]
    test = [e for e in examples if e.group in held]
    return train, test
