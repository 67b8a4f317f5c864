"""Agent sessions with their real text (the bundled agent-text traces) as sessions to replay.

The files (``marsched/loadgen/data/agent_text_*.jsonl.gz``; provenance in the README beside
them) hold one model call per line: ``timestamp`` (microseconds), ``input`` (the whole prompt
as text), ``output`` (the reply as text), ``session_id``. How a session becomes turns:

- **Order.** A session's calls, sorted by ``timestamp`` (the files are not always in time
  order; ties keep the file's order).
- **Prompt.** Each turn sends its call's ``input`` as it is, a completions prompt
  (`TextPrompt`): the trace's text, faithful to the byte, not the served model's replies. An
  agent's next input extends its previous input in most steps, so a server's prefix cache
  finds the earlier turns; the replies the server generates are not part of any later prompt.
- **Reply length.** The ``output``'s length in GPT-2 tokens (`marsched.workload.tokenizer`,
  the tokenizer the project counts text with; a modern vocabulary gives a similar count for
  English and code), at least 1.
- **Gap.** The time from one call's timestamp to the next. The trace records one time per
  call, so the gap holds the tool's (or the other agents') time together with the original
  model's time to answer: it is an upper bound of the tool time. ``--gap-scale`` and
  ``--max-gap-s`` shape it.
- **Bounded turns** (``--turn-chars N``, `bounded_texts`; 0, the default, is off). The whole
  conversations are too long for a small test model and KV cache, so each piece of text is cut
  to its first N characters: the first prompt, every reply, and every turn's new text (what its
  input adds over the previous turn's input and reply: the part after their longest common
  prefix). Turn k's prompt is then the cut pieces in order (first prompt, reply 1, new text 2,
  reply 2, ..., new text k), so turn k+1's prompt starts with turn k's prompt and reply, as in
  a conversation whose replies are fed back: a prefix cache or a kept KV finds the whole
  previous turn. The reply length is the cut reply's. Where the trace's next input does not
  extend the previous one (another agent of the session), the new text is nearly its whole
  input, cut like the rest, and the rebuilt prompt still extends the previous one.
  ``--reply-chars M`` cuts the replies to M characters instead (0: whole), keeping more of
  their spread of lengths than a cut of a few hundred characters does.

Session keys are ``<set>:<session_id>`` (``miniswe:0639...``). A file's problems raise
`AgentTextError` naming the file, the line and the field.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from importlib.resources import files

from marsched.loadgen.session import Session, TextPrompt, Turn
from marsched.workload.tokenizer import count_tokens_batch

SETS = ("miniswe", "magagent")
FIELDS = ("timestamp", "input", "output", "session_id")


class AgentTextError(ValueError):
    """A record of an agent-text file is not usable; the message names file, line and field."""


def bundled_file(name: str) -> str:
    return f"agent_text_{name}.jsonl.gz"


def load_agent_text(sets: Sequence[str] = SETS, turn_chars: int = 0, reply_chars: int | None = None) -> list[Session]:
    """The bundled sessions of `sets` (names from SETS), in file order; `turn_chars` > 0 bounds
    their turns, and `reply_chars` their replies (`bounded_texts`)."""
    sessions: list[Session] = []
    for name in sets:
        if name not in SETS:
            raise ValueError(f"unknown agent-text set {name!r}: {', '.join(SETS)}")
        resource = files("marsched.loadgen") / "data" / bundled_file(name)
        sessions += parse_agent_text(gzip.decompress(resource.read_bytes()).decode("utf-8"), name, str(resource),
                                     turn_chars, reply_chars)
    return sessions


def parse_agent_text(text: str, set_name: str, source: str, turn_chars: int = 0,
                     reply_chars: int | None = None) -> list[Session]:
    """Sessions from the lines of one file (`set_name` prefixes their keys; `source` names it in errors;
    `turn_chars` > 0 bounds the turns, `reply_chars` the replies, `bounded_texts`)."""
    problem = bounds_problem(turn_chars, reply_chars)
    if problem is not None:
        raise ValueError(problem)
    calls: dict[str, list[tuple[int, int, dict]]] = {}  # session id -> (timestamp, line, record)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = _record(line, number, source)
        calls.setdefault(record["session_id"], []).append((record["timestamp"], number, record))
    if not calls:
        raise AgentTextError(f"{source}: no records")
    ordered = {sid: [record for _, _, record in sorted(rows, key=lambda row: row[:2])] for sid, rows in calls.items()}
    texts = {sid: bounded_texts([(r["input"], r["output"]) for r in rows], turn_chars, reply_chars)
             for sid, rows in ordered.items()}
    lengths = iter(count_tokens_batch([reply for pairs in texts.values() for _, reply in pairs]))
    sessions = []
    for sid, rows in ordered.items():
        turns = []
        for index, (record, (prompt, _)) in enumerate(zip(rows, texts[sid])):
            after = rows[index + 1]["timestamp"] if index + 1 < len(rows) else record["timestamp"]
            turns.append(Turn(TextPrompt(prompt), max(next(lengths), 1), (after - record["timestamp"]) / 1e6))
        sessions.append(Session(f"{set_name}:{sid}", tuple(turns)))
    return sessions


def bounds_problem(turn_chars: int, reply_chars: int | None) -> str | None:
    """What is wrong with `--turn-chars` and `--reply-chars` together, said for the user; None if nothing."""
    if turn_chars < 0:
        return f"--turn-chars {turn_chars}: give 0 (whole turns) or a number of characters >= 1"
    if reply_chars is not None and reply_chars < 0:
        return f"--reply-chars {reply_chars}: give 0 (whole replies) or a number of characters >= 1"
    if reply_chars is not None and not turn_chars:
        return f"--reply-chars {reply_chars}: only with --turn-chars (without it, every reply is whole)"
    return None


def reply_cut(turn_chars: int, reply_chars: int | None) -> int:
    """Characters a reply keeps under `--turn-chars` and `--reply-chars` (0: all of it)."""
    if not turn_chars:
        return 0
    return turn_chars if reply_chars is None else reply_chars


def bounded_texts(calls: Sequence[tuple[str, str]], turn_chars: int,
                  reply_chars: int | None = None) -> list[tuple[str, str]]:
    """A session's (prompt, reply) texts, its calls' (input, output) in order, with every piece cut to
    `turn_chars` characters (the replies to `reply_chars`, when given; 0: whole) and each prompt
    rebuilt from the cut pieces before it (the module's "Bounded turns"); `turn_chars` 0 returns
    the calls as they are."""
    if turn_chars <= 0:
        return list(calls)
    keep = reply_cut(turn_chars, reply_chars)
    bounded: list[tuple[str, str]] = []
    prompt = ""
    for index, (given, reply) in enumerate(calls):
        if index == 0:
            new = given
        else:
            previous_input, previous_reply = calls[index - 1]
            new = given[_common_prefix_length(given, previous_input + previous_reply):]
            prompt += bounded[-1][1]
        prompt += new[:turn_chars]
        bounded.append((prompt, reply[:keep] if keep else reply))
    return bounded


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on slice equality (C-speed compares: the
    prompts run to hundreds of thousands of characters)."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low] holds; a[:high+1] != b[:high+1] past it
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _record(line: str, number: int, source: str) -> dict:
    where = f"{source}: line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise AgentTextError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise AgentTextError(f"{where}: not a JSON object")
    for key in FIELDS:
        if key not in record:
            raise AgentTextError(f"{where}: {key}: missing")
    if type(record["timestamp"]) is not int or record["timestamp"] < 0:
        raise AgentTextError(f"{where}: timestamp: must be a whole number of microseconds >= 0, "
                             f"got {record['timestamp']!r}")
    for key in ("input", "output"):
        if not isinstance(record[key], str):
            raise AgentTextError(f"{where}: {key}: must be text, got {type(record[key]).__name__}")
    sid = record["session_id"]
    if not isinstance(sid, str) or not sid or "/" in sid or len(sid) > 128:
        raise AgentTextError(f"{where}: session_id: must be 1 to 128 characters without '/', got {sid!r}")
    return record


def held_out_keys() -> frozenset[str]:
    """The session keys the packaged agent head (`learned:agent`) held out of its training, as
    its training record lists them: replaying only these measures it on sessions it never saw."""
    record = files("marsched.predict") / "heads" / "agent" / "train.json"
    return frozenset(json.loads(record.read_text())["held_out_sessions"])
