"""The requests `marsched loadgen --workload claude-code` replays, as the simulator runs them.

Loadgen draws its conversations with the simulator's own arrival process (`loadgen.arrivals`), so
the same seed, rate and duration give the same tasks at the same times. Here each task is the
simulator's request with the replay's shaping applied the way loadgen applies it:

- token counts × ``--token-scale`` (`workload.token_scale.scale_tokens`, before the draw, as
  `loadgen.claude_code` scales its sessions);
- cut to its first ``--max-turns`` model calls; nothing is waited for after the last reply
  (loadgen ends the conversation with it): a call there takes no time;
- every tool gap shaped by ``--gap-scale`` and ``--max-gap-s`` (`loadgen.session.shape_gap`);
- a subagent whose parent's calling turn was cut is left out, as loadgen leaves it out.
"""

from __future__ import annotations

from dataclasses import replace

from marsched.loadgen.options import CLAUDE_CODE, LoadgenOptions
from marsched.loadgen.session import shape_gap
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.loader import load_named
from marsched.workload.model import Request
from marsched.workload.token_scale import scale_tokens


def as_replayed(request: Request, max_turns: int, gap_scale: float, max_gap_s: float | None) -> Request:
    """`request` cut to `max_turns` calls (0: all), its tool gaps shaped, no time after its last reply."""
    segments = request.segments[:max_turns] if max_turns > 0 else request.segments
    shaped = []
    for index, segment in enumerate(segments):
        if segment.api is None:
            shaped.append(segment)
            continue
        # After the last reply loadgen waits for nothing; a call kept there (of no time) still
        # starts the subagents it starts, as loadgen starts them when that turn has ended.
        last = index == len(segments) - 1
        duration_s = 0.0 if last else shape_gap(segment.api.duration_s, gap_scale, max_gap_s)
        shaped.append(replace(segment, api=replace(segment.api, duration_s=duration_s)))
    return replace(request, segments=tuple(shaped))


def replayed_requests(load: LoadgenOptions) -> list[Request]:
    """The tasks loadgen sends for `load`, in arrival order, as simulator requests."""
    if load.workload != CLAUDE_CODE:
        raise ValueError(f"the twin replays --workload {CLAUDE_CODE}, not {load.workload!r}")
    templates = [scale_tokens(t, load.token_scale) for t in load_named(CLAUDE_CODE)]
    kept_calls: dict[str, int] = {}  # request id -> the calls it keeps, for its subagents
    requests = []
    for request in poisson_arrivals(templates, load.rate, load.duration_s, load.seed):
        spawn = request.spawned_by
        if spawn is not None and spawn.segment_index >= kept_calls.get(spawn.parent_id, 0):  # loadgen's rule
            continue
        replayed = as_replayed(request, load.max_turns, load.gap_scale, load.max_gap_s)
        kept_calls[request.request_id] = len(replayed.segments)
        requests.append(replayed)
    return requests
