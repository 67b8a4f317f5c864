"""Admissions follow the ranking key, promoted requests first.

The trace records each admitted request's key (`score`, lower runs first) and, with each
`schedule` event, the lowest key left waiting outside the promoted lane (`next_score`). So:
a request admitted by rank while a promoted one waits, a promoted request admitted out of
lane order, or a request admitted with a key above one left waiting, is out of order. For
first-come-first-served orders the key itself is checked too: the arrival time (`fcfs`), or
the time of the last re-entry after a call (`fcfs-reentry`, stock vLLM). Memory × time and
remaining-tokens keys depend on the engine's load and cost model, so the audit takes the
recorded key and checks the order it implies; it does not recompute it.
"""

from __future__ import annotations

from marsched.audit.declared import Declared
from marsched.audit.keys import recompute_key
from marsched.audit.queue_model import QueueModel
from marsched.audit.reader import Line
from marsched.audit.violations import Check, Violation
from marsched.policy.policy import Order

# Keys are compared with this relative tolerance (they are floats that went through JSON);
# FCFS keys against event times with an absolute one (engines stamp events a hair later than
# they read the clock for the key; times are written to the microsecond).
_REL = 1e-9
_FCFS_SLACK_S = 0.05


def _above(a: float, b: float) -> bool:
    return a > b + _REL * max(1.0, abs(b))


class RankingOrder:
    def __init__(self, report, declared: Declared, model: QueueModel) -> None:
        self.report = report
        self.order = declared.order
        self.for_life = declared.starvation.for_life
        self.model = model
        self.key_policy = declared.key_policy
        self.iteration: int | None = None
        self.ranked: list[Line] = []  # this iteration's admissions by rank

    def _violation(self, line: Line, message: str, *others: Line | None) -> None:
        e = line.event
        lines = (line.number, *(o.number for o in others if o is not None))
        self.report(Violation(Check.ORDER, e.get("rid"), e["t"], message, lines))

    def _new_iteration(self, event: dict) -> None:
        if event["iteration"] != self.iteration:
            self.iteration = event["iteration"]
            self.ranked = []

    def on_admit(self, line: Line) -> None:
        e = line.event
        self._new_iteration(e)
        waiting = self.model.waiting.get(e["rid"])
        if waiting is None:
            self._violation(line, "admitted while not in the waiting queue (admitted twice, or never queued)")
            return
        if self.key_policy is not None and e.get("key_basis"):
            self._check_recomputed(line)
        if waiting.promoted:
            first = self.model.first_promoted()
            if first is not None and first is not waiting:
                how = "by arrival (promoted for life)" if self.for_life else "in promotion order"
                self._violation(line, f"promoted requests are admitted {how}, but {first.rid} "
                                      f"(promoted at t={first.promoted_at.event['t']:.6g}s) was still waiting",
                                first.promoted_at, waiting.promoted_at)
            if not e["promoted"]:
                self._violation(line, "a promoted request was admitted as if by rank (admit says promoted=false)",
                                waiting.promoted_at)
            return
        if e["promoted"]:
            self._violation(line, "admitted from the promoted lane (promoted=true) but never promoted")
            return
        first = self.model.first_promoted()
        if first is not None:
            self._violation(line, f"admitted by rank (score {e['score']:.6g}) while {first.rid}, promoted at "
                                  f"t={first.promoted_at.event['t']:.6g}s, waited: promoted requests go ahead of "
                                  "the score order", first.promoted_at)
        self._check_key(line, waiting)
        if self.ranked and _above(self.ranked[-1].event["score"], e["score"]):
            before = self.ranked[-1]
            self._violation(line, f"admitted with score {e['score']:.6g} after {before.event['rid']} with the worse "
                                  f"score {before.event['score']:.6g} in the same iteration", before)
        self.ranked.append(line)

    def _check_recomputed(self, line: Line) -> None:
        e = line.event
        try:
            expected = recompute_key(self.key_policy, e["key_basis"])
        except (KeyError, TypeError, ValueError) as error:
            self._violation(line, f"its key_basis cannot be read ({error!r}), so its key cannot be checked")
            return
        if abs(e["score"] - expected) > 1e-6 * max(1.0, abs(expected)):
            basis = e["key_basis"]
            self._violation(line, f"its score {e['score']:.6g} is not the {self.order.value} key of its own "
                                  f"predictions ({expected:.6g} from {len(basis['predictions'])} predicted segment(s), "
                                  f"context {basis['context_tokens']}, τ={basis['tau_s']:.3g}s): the queue ranks by "
                                  "something else")

    def _check_key(self, line: Line, waiting) -> None:
        e = line.event
        arrival = self.model.arrival.get(e["rid"])
        if arrival is None:
            return
        if self.order is Order.FCFS and abs(e["score"] - arrival) > _FCFS_SLACK_S:
            self._violation(line, f"first come first served by arrival, but its key is {e['score']:.6g}, not its "
                                  f"arrival time {arrival:.6g}s", waiting.entered)
        elif self.order is Order.FCFS_REENTRY:
            entry = self.model.requeued_t.get(e["rid"], arrival)
            if abs(e["score"] - entry) > _FCFS_SLACK_S:
                self._violation(line, f"first come first served by last entry, but its key is {e['score']:.6g}, "
                                      f"not the time it last entered the queue after a call ({entry:.6g}s)",
                                waiting.entered)

    def _entered(self, line: Line) -> None:
        # An engine takes requests into the queue before it admits in a pass; one entering after
        # an admission starts a new pass (the simulator's idle passes share an iteration number).
        self.ranked = []

    on_arrive = on_preempt = _entered

    def on_resume(self, line: Line) -> None:
        if line.event["where"] != "device":
            self.ranked = []

    def on_schedule(self, line: Line) -> None:
        e = line.event
        self._new_iteration(e)
        best = e["next_score"]
        if best is not None:
            for admit in self.ranked:
                if _above(admit.event["score"], best):
                    self._violation(admit, f"admitted with score {admit.event['score']:.6g} while a request with "
                                           f"the better (lower) score {best:.6g} was left waiting at the end of "
                                           f"iteration {e['iteration']}", line)
        self.ranked = []
