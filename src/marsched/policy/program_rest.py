"""The rest of a request after its current segment, as a server can know it: learnt from the
requests that ended, never read from the trace (the knowledge boundary, docs/policies.md).

A request in the simulator is a program of segments, as a conversation is a program of turns
over HTTP: the same outlook (`program.ProgramOutlook`) prices the rest in both. `ProgramRest`
keeps, per task class, the segment counts of the requests that ended (`ProgramLengths`), their
later segments' replies and the context each segment added; a request that has run `k`
segments gets from them the turns it has left (`RestRule`), its replies (its own so far, pulled
toward its class's) and its growth per turn (likewise).

`RestRule.PLAN` is the bound: the later segments as the trace has them, each predicted
(`Policy._outlook`). It is foreknowledge, shown only as a bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from marsched.policy.program import ProgramLengths, ProgramOutlook
from marsched.predict.online import RunningMean
from marsched.workload.model import Segment
from marsched.workload.past import RequestPast

OWN_WEIGHT = 1.0  # the class's mean counts as this many of the request's own segments


class RestRule(str, Enum):
    PLAN = "plan"  # the bound: the trace's later segments, predicted one by one
    MEAN = "mean"  # the conditional mean of the turns left, priced as if exactly that many came
    GITTINS = "gittins"  # the Gittins rank over the turns-left distribution (`gittins.py`)


DEFAULT_REST = RestRule.GITTINS.value  # chosen by measurement (docs/results.md, "The knowledge boundary")


def _blend(own_total: float, own_count: int, prior: RunningMean | None, fallback: float) -> float:
    """The request's own mean pulled toward its class's (`OWN_WEIGHT` segments' worth)."""
    class_mean = prior.mean(fallback) if prior else fallback
    return RunningMean(own_total, own_count).shrunk(class_mean, OWN_WEIGHT)


@dataclass
class ProgramRest:
    _lengths: dict[str, ProgramLengths] = field(default_factory=dict)
    _replies: dict[str, RunningMean] = field(default_factory=dict)  # later segments' output tokens
    _growth: dict[str, RunningMean] = field(default_factory=dict)  # context added per segment

    def ended(self, task_class: str, segments: Sequence[Segment]) -> None:
        """A request of `task_class` ended after `segments` (all of them in its past now)."""
        for key in dict.fromkeys((task_class, "")):  # its class, and every class (for a class not seen yet)
            self._lengths.setdefault(key, ProgramLengths()).ended(len(segments))
            replies, growth = self._replies.setdefault(key, RunningMean()), self._growth.setdefault(key, RunningMean())
            for before, after in zip(segments, segments[1:]):
                replies.add(after.output_tokens)
                growth.add(after.context_tokens - before.context_tokens)

    def lengths(self, task_class: str) -> ProgramLengths:
        known = self._lengths.get(task_class)
        if known is not None and len(known):
            return known
        return self._lengths.get("") or self._lengths.setdefault(task_class, ProgramLengths())

    def outlook(self, past: RequestPast, predicted_tokens: int) -> tuple[ProgramOutlook, list[tuple[int, float]]]:
        """The mean outlook of `past`'s request, whose current segment is predicted to reply
        `predicted_tokens`, and its distribution of turns left as (turns, weight)."""
        turns_so_far = past.segment_index + 1
        lengths = self.lengths(past.task_class)
        own_replies = [s.output_tokens for s in past.done[1:]]
        reply = _blend(sum(own_replies), len(own_replies), self._replies.get(past.task_class)
                       or self._replies.get(""), float(predicted_tokens))
        grown = past.context_tokens - past.prompt_tokens
        growth = _blend(grown, len(past.done), self._growth.get(past.task_class) or self._growth.get(""), reply)
        counts = lengths.turns_left_counts(turns_so_far)
        return ProgramOutlook(lengths.turns_left(turns_so_far), reply, growth), counts


def call_chance(counts: list[tuple[int, float]]) -> float:
    """The chance, by `counts` of turns left, that another turn follows (the segment calls)."""
    total = sum(w for _, w in counts)
    ending = sum(w for turns, w in counts if turns == 0)
    return 1.0 - ending / total if total else 1.0
