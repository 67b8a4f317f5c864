"""The augmented-request domain model: requests made of segments split by API calls."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum


class ApiType(str, Enum):
    """The augmentation behind an API call: the six of the INFERCEPT mixture, an agent's tool, a catch-all."""

    MATH = "math"
    QA = "qa"
    VE = "ve"
    CHATBOT = "chatbot"
    TTS = "tts"
    IMAGE = "image"
    # A coding or research agent's tool call (search, file read, code run): its own type so that
    # per-type duration estimates of agent workloads are not mixed with unlabelled calls.
    TOOL = "tool"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One external call that ends a segment.

    `kept_tokens` is how much of the context at the call the next segment keeps, as its
    leading prefix: None keeps all of it (the context only grows, the usual case). Fewer
    tokens mean the client rewrote its context during the call (an agent compacting its
    history): the KV of the dropped tail is useless afterwards, and the next segment's
    context is `kept_tokens + return_tokens`, of which the `return_tokens` are new.
    """

    api_type: ApiType
    duration_s: float
    return_tokens: int
    kept_tokens: int | None = None

    def next_context(self, context_at_call: int) -> int:
        """The context of the segment after this call, from the context at the call."""
        kept = context_at_call if self.kept_tokens is None else self.kept_tokens
        return kept + self.return_tokens

    @property
    def compacts(self) -> bool:
        """Whether the next segment keeps less than the whole context at the call.

        `build_request` stores a call that keeps the whole context with `kept_tokens` None.
        """
        return self.kept_tokens is not None


@dataclass(frozen=True, slots=True)
class Spawn:
    """Where a request that another one starts (an agent's subagent) comes from: its parent and the
    parent's segment whose call starts it. It runs beside the parent, during that call."""

    parent_id: str
    segment_index: int


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A conversation's later task: it comes `gap_s` after its previous task (`previous_id`) ends
    (the human's time between that answer and this task's first call), and the first
    `shared_tokens` of its prompt are that task's context, whose KV blocks are the same."""

    previous_id: str
    gap_s: float
    shared_tokens: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of generation: `context_tokens` at its start, `output_tokens` generated, then `api` (or the end)."""

    context_tokens: int
    output_tokens: int
    api: ApiCall | None = None

    @property
    def context_at_call(self) -> int:
        return self.context_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Request:
    """An augmented request. Every segment but the last ends with an API call; the last may too.

    A request whose last segment ends with a call (a *trailing call*; the published
    multi-API mixture has 184 of them) is finished when that call returns: the returned
    tokens are appended and nothing more is generated, so the engines compute nothing
    after it and free its KV cache at the call.
    """

    request_id: str
    segments: tuple[Segment, ...]
    arrival_s: float = 0.0
    template_id: str = field(default="", compare=False)
    # A subagent's parent. Its `arrival_s` is then counted from the parent's arrival and is the
    # parent's call in the recorded timeline; arrival processes move the two together
    # (`poisson_arrivals`).
    spawned_by: Spawn | None = None
    # The conversation whose context this request continues, shared by its tasks: a task's KV
    # blocks are its conversation's content, which the next task's prompt starts with. Empty: the
    # request's context is its own. Session arrivals (`workload/sessions.py`) replay a
    # conversation's tasks from these and from each task's start in the recorded conversation
    # (a template's `arrival_s`).
    conversation: str = ""
    follows: FollowUp | None = None
    # The request's class as its prompt shows it, before any call (`past.RequestPast`): the
    # INFERCEPT loader sets the augmentation of the request's data set; "" where a trace says none.
    task_class: str = field(default="", compare=False)

    @property
    def prompt_tokens(self) -> int:
        return self.segments[0].context_tokens

    @property
    def num_calls(self) -> int:
        return sum(1 for s in self.segments if s.api is not None)

    @property
    def ends_with_call(self) -> bool:
        return self.segments[-1].api is not None

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.segments)

    @property
    def api_time_s(self) -> float:
        return sum(s.api.duration_s for s in self.segments if s.api is not None)

    @property
    def api_return_tokens(self) -> int:
        return sum(s.api.return_tokens for s in self.segments if s.api is not None)

    @property
    def final_context_tokens(self) -> int:
        """The longest context whose KV cache is ever computed (a trailing call's return is not).

        The last segment's context at its end, unless a call compacted the context: then the
        longest may come earlier.
        """
        return max(s.context_at_call for s in self.segments)

    def arriving_at(self, arrival_s: float, request_id: str) -> "Request":
        """This request's shape under a new id and arrival time (trace sampling reuses templates), a
        conversation of its own: what it shared with the template's tasks is another instance's."""
        return replace(self, request_id=request_id, arrival_s=arrival_s, template_id=self.template_id or self.request_id,
                       conversation="", follows=None)


def build_request(
    request_id: str,
    prompt_tokens: int,
    parts: list[tuple[int, ApiCall | None]],
    arrival_s: float = 0.0,
) -> Request:
    """Build a request from its prompt and (output tokens, call) per segment; contexts accumulate.

    The context of segment i+1 is the context of segment i, plus its output, plus the call's return;
    a call that keeps fewer tokens (`ApiCall.kept_tokens`) replaces the first two by what it keeps.
    A call that keeps the whole context at the call is stored with `kept_tokens` None, so that
    `ApiCall.compacts` says whether a call really shrinks the context.
    The last segment may end with a call (a trailing call, see `Request`).
    """
    if not parts:
        raise ValueError(f"request {request_id!r}: no segments")
    segments = []
    context = prompt_tokens
    for index, (output_tokens, api) in enumerate(parts):
        last = index == len(parts) - 1
        if not last and api is None:
            raise ValueError(f"request {request_id!r}: segment {index} has no API call but is not the last")
        at_call = context + output_tokens
        if api is not None and api.kept_tokens is not None:
            if not 0 <= api.kept_tokens <= at_call:
                raise ValueError(f"request {request_id!r}: segment {index} keeps {api.kept_tokens} tokens "
                                 f"of a {at_call}-token context")
            if api.kept_tokens == at_call:
                api = replace(api, kept_tokens=None)
        segments.append(Segment(context, output_tokens, api))
        context = api.next_context(at_call) if api else at_call
    return Request(request_id, tuple(segments), arrival_s)


def scale_api_time(request: Request, factor: float) -> Request:
    """The request with every call's duration × `factor`; tokens and arrival unchanged.

    A regime map's API-time axis: slower or faster tools on the same conversations.
    """
    if not (factor >= 0 and factor != float("inf")):
        raise ValueError(f"API time scale must be a finite number >= 0, got {factor!r}")
    if factor == 1:
        return request
    segments = tuple(replace(s, api=replace(s.api, duration_s=s.api.duration_s * factor)) if s.api else s
                     for s in request.segments)
    return replace(request, segments=segments)
