"""The bundled Claude Code sessions (token counts only) as sessions to replay with filler text.

The sessions are the simulator's (`marsched.workload.claude_code`: one request per task, a
tool gap is a call), scaled the simulator's way (`marsched.workload.token_scale.scale_tokens`,
``--token-scale``), so that a replay and ``marsched simulate --trace claude-code`` run the
same shapes. A request becomes a session; its segment i becomes turn i:

- turn 0's prompt is filler of the first segment's context; turn i+1's prompt is the
  context so far (turn i's prompt and the reply the server sent, or only their first
  ``kept_tokens`` where the client compacted) and filler of the call's return
  (`GrownPrompt`, `marsched.loadgen.filler`);
- the reply length is the segment's output tokens (at least 1);
- the gap after turn i is its call's duration (the trace's ``think_time``).

A subagent's tasks are sessions that start when the parent's turn that called the subagent
has ended (`marsched.loadgen.replay`): the trace's own offsets are in its own time, which
gap shaping and the server's speed change.
"""

from __future__ import annotations

from collections.abc import Sequence

from marsched.loadgen.session import GrownPrompt, Session, Turn
from marsched.workload.loader import load_named
from marsched.workload.model import Request
from marsched.workload.token_scale import scale_tokens


def load_claude_code(token_scale: float = 1.0) -> list[Session]:
    """The bundled sessions, token counts × `token_scale`."""
    return sessions_from_requests(load_named("claude-code"), token_scale)


def sessions_from_requests(requests: Sequence[Request], token_scale: float = 1.0) -> list[Session]:
    return [session_from_request(scale_tokens(request, token_scale)) for request in requests]


def session_from_request(request: Request) -> Session:
    turns = []
    previous = None
    for segment in request.segments:
        if previous is None:
            prompt = GrownPrompt(0, segment.context_tokens)
        else:
            prompt = GrownPrompt(previous.api.kept_tokens, previous.api.return_tokens)
        gap = segment.api.duration_s if segment.api is not None else 0.0
        turns.append(Turn(prompt, max(segment.output_tokens, 1), gap))
        previous = segment
    spawn = request.spawned_by
    return Session(request.request_id, tuple(turns), spawn.parent_id if spawn else None,
                   spawn.segment_index if spawn else 0)
