"""A request's progress as the policy sees it; both engines keep one per live request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from marsched.policy.cost_model import CostModel
from marsched.policy.load import EngineLoad
from marsched.policy.program import ProgramOutlook
from marsched.policy.strategy import Strategy
from marsched.predict.segment import SegmentPrediction
from marsched.workload.model import Request, Segment


@dataclass(frozen=True, slots=True)
class StrategyAssignment:
    """A strategy fixed for one segment's call, when and from what it was decided."""

    segment_index: int
    strategy: Strategy
    assigned_s: float
    context_tokens: int  # C used for the decision (predicted or actual)
    api_s: float  # T used for the decision (predicted, or actual remaining)
    reason: str  # "ahead", "at-call", "reconsidered", "fixed", "host-full"


@dataclass(slots=True)  # not frozen: built at every pop
class KeyBasis:
    """What a queue key was computed from (the request's state and the engine's load then), so
    that the event trace can show it and an audit can recompute the key from the predictions."""

    load: EngineLoad
    segment_index: int
    context_tokens: int
    computed_tokens: int
    generated: int
    strategy: Strategy | None
    cost: CostModel | None = None  # the cost model the key was computed with (a server may learn a new one)


@dataclass(slots=True, eq=False)
class RequestProgress:
    request: Request
    order_s: float  # FCFS position: arrival, or re-entry time for policies that requeue at the tail
    segment_index: int = 0
    generated: int = 0  # tokens generated in the current segment
    context_tokens: int = 0  # sequence length: prompt + generated + API returns
    computed_tokens: int = 0  # tokens whose KV is on the device
    predictions: list[SegmentPrediction] = field(default_factory=list)
    strategy: Strategy | None = None
    assignments: list[StrategyAssignment] = field(default_factory=list)
    api_started_s: float | None = None
    waited_iterations: int = 0  # starvation counter carried while out of the queue (kept across preemption)
    promoted: bool = False  # starvation prevention moved it ahead of the queue's order
    protected_until_iteration: int = -1  # starvation quantum: not a preemption victim before this
    protected_segment: int = -1  # segment protection: not a preemption victim while in this segment
    waited_s: float = 0.0  # like `waited_iterations`, in engine seconds
    elder: bool = False  # promoted for the rest of its life (starvation `for_life`)
    ran_before: bool = False  # admitted at least once (a later stay in the queue is a re-queue)
    # What the queue last reported, for the event trace (the audit checks the order from them):
    left_key: float = math.nan  # its ranking key when it last left the queue
    left_promoted: bool = False  # whether it left from the promoted lane
    counter: float = 0.0  # its starvation counter when it last left the queue or was promoted
    key_basis: KeyBasis | None = None  # what its current queue key was computed from
    attained_iterations: int = 0  # iterations it was scheduled in (Autellix's attained service)
    attained_before_segment: int = 0  # the same, when its current segment began
    program: ProgramOutlook | None = None  # a conversation turn's predicted rest of its program (`program.py`)
    # The distribution of turns left the program's Gittins rank is taken over, as (turns, weight)
    # (`gittins.py`); None: `program` is priced as it is.
    rest_counts: list[tuple[int, float]] | None = None
    # The Nudge order (`nudge.py`): whether it entered the waiting queue before (a request nudges
    # only at its first entry), and whether a small arrival swapped it back once (never again).
    queued_before: bool = False
    nudged: bool = False

    def __post_init__(self) -> None:
        if not self.context_tokens:
            self.context_tokens = self.request.prompt_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def segment(self) -> Segment:
        return self.request.segments[self.segment_index]

    @property
    def pending_tokens(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.context_tokens - self.computed_tokens

    @property
    def in_last_segment(self) -> bool:
        return self.segment_index == len(self.request.segments) - 1

    def assign(self, assignment: StrategyAssignment) -> None:
        self.strategy = assignment.strategy
        self.assignments.append(assignment)
