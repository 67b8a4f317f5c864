"""What a serving engine knows of a request when one of its segments starts: its past.

A server sees a request's prompt, the segments it has finished (their tokens and calls, with the
tools and times those calls took) and the context it carries now. It never sees the calls still
to come: not their count, tools, lengths or times. `RequestPast` holds exactly the first, so
that a predictor given one cannot read the rest (the knowledge boundary, docs/policies.md).

`task_class` is the request's class as its prompt shows it (`Request.task_class`): for the
INFERCEPT mixture, the augmentation whose data set the prompt comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marsched.workload.model import Request, Segment


@dataclass(frozen=True, slots=True)
class RequestPast:
    request_id: str
    task_class: str
    prompt_tokens: int
    context_tokens: int  # at the start of the current segment
    done: tuple[Segment, ...]  # the segments finished, each with the call that ended it
    template_id: str = field(default="", compare=False)  # the trace request this one replays (`Request.template_id`): its prompt's identity

    @classmethod
    def of(cls, request: Request, segment_index: int) -> "RequestPast":
        """`request` as known when its segment `segment_index` starts."""
        if not 0 <= segment_index < len(request.segments):
            raise IndexError(f"request {request.request_id!r} has no segment {segment_index}")
        return cls(request.request_id, request.task_class, request.prompt_tokens,
                   request.segments[segment_index].context_tokens, request.segments[:segment_index],
                   request.template_id)

    @property
    def segment_index(self) -> int:
        return len(self.done)

    @property
    def last_call_type(self) -> str | None:
        """The tool of the latest call made, or None before the first."""
        return self.done[-1].api.api_type.value if self.done else None

    @property
    def call_type_guess(self) -> str:
        """The type the next call most likely has: the latest call's (calls of one program tend to
        repeat), else the task's class, else "" (unknown)."""
        return self.last_call_type or self.task_class
