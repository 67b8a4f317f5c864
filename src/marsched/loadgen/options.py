"""`marsched loadgen`'s settings: what to replay, how fast, against which server; each one checked."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from marsched.bench.options import check_nonnegative, check_positive, check_seed
from marsched.loadgen.agent_text import SETS, bounds_problem, held_out_keys, load_agent_text
from marsched.loadgen.client import base_url
from marsched.loadgen.session import Session

AGENT_TEXT = "agent-text"
CLAUDE_CODE = "claude-code"
WORKLOADS = (AGENT_TEXT, *(f"{AGENT_TEXT}:{name}" for name in SETS), CLAUDE_CODE)
ALL_SESSIONS, HELD_OUT = "all", "held-out"
SESSION_CHOICES = (ALL_SESSIONS, HELD_OUT)


@dataclass(frozen=True, slots=True)
class LoadgenOptions:
    url: str
    workload: str = AGENT_TEXT
    model: str | None = None  # None: the first model the server lists
    rate: float = 0.2  # conversations per second
    duration_s: float = 60.0  # of arrivals; the run then waits for the conversations to end
    seed: int = 0
    gap_scale: float = 1.0
    max_gap_s: float | None = None
    token_scale: float = 1.0  # claude-code only
    max_turns: int = 0  # per conversation; 0: all
    max_tokens: int = 4096  # every turn's max_tokens: a fixed cap, never the reply's length
    conversation_keys: bool = True
    request_timeout_s: float = 600.0
    turn_chars: int = 0  # agent-text only: cut every turn's new text and reply to this many characters; 0: off
    sessions: str = ALL_SESSIONS  # agent-text only: "held-out", the sessions the packaged agent head never saw
    max_concurrency: int = 0  # conversations running at once; the others wait for a slot. 0: no limit
    oracle_predictions: bool = False  # a diagnostic: each turn tells the scheduler its reply's length
    reply_chars: int | None = None  # with turn_chars: cut the replies to this many instead (0: whole)

    def check(self) -> str:
        """The server's root URL; ValueError naming the flag of the first bad value."""
        root = base_url(self.url)
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload {self.workload!r}: give one of {', '.join(WORKLOADS)}")
        check_positive("--rate", self.rate)
        check_positive("--duration", self.duration_s)
        check_seed(self.seed)
        check_nonnegative("--gap-scale", self.gap_scale)
        if self.max_gap_s is not None:
            check_nonnegative("--max-gap-s", self.max_gap_s)
        check_positive("--token-scale", self.token_scale)
        if self.token_scale != 1 and self.workload != CLAUDE_CODE:
            raise ValueError(f"--token-scale {self.token_scale:g}: only for --workload {CLAUDE_CODE} "
                             "(agent-text sends its text as it is)")
        problem = bounds_problem(self.turn_chars, self.reply_chars)
        if problem is not None:
            raise ValueError(problem)
        if self.turn_chars and self.workload == CLAUDE_CODE:
            raise ValueError(f"--turn-chars {self.turn_chars}: only for --workload {AGENT_TEXT} "
                             "(claude-code has token counts: use --token-scale)")
        if self.sessions not in SESSION_CHOICES:
            raise ValueError(f"--sessions {self.sessions!r}: give one of {', '.join(SESSION_CHOICES)}")
        if self.sessions == HELD_OUT and self.workload == CLAUDE_CODE:
            raise ValueError(f"--sessions {HELD_OUT}: only for --workload {AGENT_TEXT} (the agent head "
                             "trained on agent-text sessions)")
        if self.max_turns < 0:
            raise ValueError(f"--max-turns {self.max_turns}: give 0 (every turn) or a number >= 1")
        if self.max_concurrency < 0:
            raise ValueError(f"--max-concurrency {self.max_concurrency}: give 0 (no limit) or a number of "
                             "conversations >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens {self.max_tokens}: give a number of tokens >= 1")
        check_positive("--request-timeout", self.request_timeout_s)
        if self.model is not None and not self.model.strip():
            raise ValueError("--model '': give the served model's name, or leave it out for the server's first")
        if self.rate * self.duration_s > 1e6 or not math.isfinite(self.rate * self.duration_s):
            raise ValueError(f"--rate {self.rate:g} --duration {self.duration_s:g}: more than a million "
                             "conversations; lower one of them")
        return root

    def settings(self) -> dict[str, Any]:
        """The settings as the report records them (the URL and model are under `server`)."""
        values = asdict(self)
        del values["url"], values["model"]
        return values


def load_sessions(options: LoadgenOptions) -> list[Session]:
    """The workload's sessions (with --sessions held-out, only those the packaged agent head held
    out of its training), cut to --max-turns."""
    if options.workload == CLAUDE_CODE:
        from marsched.loadgen.claude_code import load_claude_code

        sessions = load_claude_code(options.token_scale)
    else:
        _, _, name = options.workload.partition(":")
        sessions = load_agent_text((name,) if name else SETS, options.turn_chars, options.reply_chars)
        if options.sessions == HELD_OUT:
            held = held_out_keys()
            sessions = [session for session in sessions if session.key in held]
    return [session.first_turns(options.max_turns) for session in sessions]
