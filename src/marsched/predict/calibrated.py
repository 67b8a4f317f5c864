"""A learned head calibrated online by what the server has served (`--predictor learned-online[:HEAD]`).

A head trained on one kind of text can be far off on another: on agent replies of a family it
never saw, a head's estimates can be 30 times too long or too short, and still rank the replies
somewhat. `CalibratedLength` keeps the head's ranking and learns its scale from the replies
served so far. For a segment whose request has text (a trace's text records, as `LearnedLength`
reads them: `marsched.predict.texts`), the prediction is the head's estimate times a factor:

- **per task class and position** (the request's first segment, or a later one): the
  geometric mean of observed / estimated over the segments of that class and position served
  so far, shrunk toward the position's factor over every class, which is shrunk toward 1; each
  prior counts as `prior_weight` observations;
- **per request**, from its own earlier segments: each ratio observed / estimated counts as
  much as one observation, beside the class's factor, which counts as `class_weight` of them.

Every ratio is clipped to [1/`max_factor`, `max_factor`] before it is averaged (in logs), and so
is the factor. One reply a million times its estimate moves a class that has seen nothing else
by at most `max_factor` ^ ((1 + 2w) / (1 + w)²), w = `prior_weight` (7.5× with the defaults: the
ratio counts in its class and in its position's pool), and a class that has seen 20 replies by
under 25%. A segment without text gets `OnlineLength`'s rule,
which learns from every segment served, with text or not.

**What it reads.** Only the past (`RequestPast`): the head's estimate for segment i reads
the text that starts it (the prompt, or the previous call's return), its context's length and
the previous segment's true length, which is done when segment i starts; the factor reads the
segments done and the ones served before. Nothing of segment i's own length or later.
The estimates are made once per trace before a run (`prepare`), keyed by the request's
template id (a sampled request replays its template's text).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from marsched.predict.online import OnlineLength, RunningMean, position_of
from marsched.workload.model import Request
from marsched.workload.past import RequestPast

MAX_FACTOR = 100.0  # a ratio, and the factor, are clipped to [1/MAX_FACTOR, MAX_FACTOR]
PRIOR_WEIGHT = 3.0  # the prior factor (the parent's, at the root 1) counts as this many observations
CLASS_WEIGHT = 2.0  # the class's factor counts as this many of the request's own ratios


@dataclass
class CalibratedLength:
    """The head's estimate times an online factor; `OnlineLength` without text (module docstring).

    `table`: request (template) id -> the head's estimate per segment. None: made from the trace
    by `prepare`, with the head in `directory` (None: the packaged default head); given: used as
    it is (the evaluation and the tests).
    """

    directory: str | None = None
    table: Mapping[str, Sequence[float]] | None = None
    max_factor: float = MAX_FACTOR
    prior_weight: float = PRIOR_WEIGHT
    class_weight: float = CLASS_WEIGHT
    knowable: bool = True
    online: OnlineLength = field(default_factory=OnlineLength)
    _by_class: dict[tuple[str, str], RunningMean] = field(default_factory=dict)
    _by_position: dict[str, RunningMean] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.max_factor >= 1 or not math.isfinite(self.max_factor):
            raise ValueError(f"learned-online: max_factor must be a finite number >= 1, got {self.max_factor}")
        if self.prior_weight <= 0 or self.class_weight < 0:
            raise ValueError("learned-online: prior_weight must be > 0 and class_weight >= 0")
        if self.table is None:
            from marsched.predict.learned import load_model

            load_model(self.directory)  # a missing or broken head fails here, before any run

    @property
    def name(self) -> str:
        return "learned-online" if self.directory is None else f"learned-online:{self.directory}"

    def prepare(self, templates: Sequence[Request], trace: str | None = None) -> None:
        from marsched.predict.learned import _trace_table

        self.table = dict(_trace_table(self.directory, str(trace))) if trace is not None else {}

    def estimate(self, past: RequestPast, index: int) -> float | None:
        """The head's estimate for the request's segment `index`, or None (no text)."""
        estimates = (self.table or {}).get(past.template_id or past.request_id)
        if estimates is None or index >= len(estimates):
            return None
        return max(float(estimates[index]), 1.0)

    def _log_ratio(self, observed: float, estimate: float) -> float:
        bound = math.log(self.max_factor)
        return min(bound, max(-bound, math.log(max(observed, 1.0) / estimate)))

    def class_log_factor(self, past: RequestPast) -> float:
        """The log factor of the request's class and position: shrunk to the position's, shrunk to 0."""
        position = position_of(past)
        parent = self._by_position.get(position, RunningMean()).shrunk(0.0, self.prior_weight)
        return self._by_class.get((past.task_class, position), RunningMean()).shrunk(parent, self.prior_weight)

    def factor(self, past: RequestPast) -> float:
        """What the head's estimate for the current segment is multiplied by."""
        own = [self._log_ratio(segment.output_tokens, estimate) for index, segment in enumerate(past.done)
               if (estimate := self.estimate(past, index)) is not None]
        total = sum(own) + self.class_weight * self.class_log_factor(past)
        weight = len(own) + self.class_weight
        log_factor = total / weight if weight else 0.0
        bound = math.log(self.max_factor)
        return math.exp(min(bound, max(-bound, log_factor)))

    def predict_past(self, past: RequestPast) -> int:
        estimate = self.estimate(past, past.segment_index)
        if estimate is None:
            return self.online.predict_past(past)
        return max(1, round(estimate * self.factor(past)))

    def predict(self, request: Request, segment_index: int) -> int:
        return self.predict_past(RequestPast.of(request, segment_index))

    def observe_output(self, past: RequestPast, output_tokens: int) -> None:
        """The segment that started with `past` generated `output_tokens`."""
        self.online.observe_output(past, output_tokens)
        estimate = self.estimate(past, past.segment_index)
        if estimate is None:
            return
        ratio = self._log_ratio(output_tokens, estimate)
        position = position_of(past)
        self._by_class.setdefault((past.task_class, position), RunningMean()).add(ratio)
        self._by_position.setdefault(position, RunningMean()).add(ratio)
