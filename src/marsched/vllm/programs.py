"""A conversation's turns as one program to the scheduler: one starvation clock, one attained
service, one arrival, and the predicted rest of the program in each turn's ranking key.

Over HTTP each turn is a request of its own. Without this, a long agent program starts every turn
with a fresh starvation counter, so it can wait up to the threshold at every turn, and the key
ranks a turn alone. Here a follow-up turn starts with what its program has waited and been
served so far (`RequestProgress.waited_iterations`, `waited_s`, `attained_iterations`: Autellix's
PLAS ranks by the last, as the simulator ranks a request's later calls), stays promoted where a
promotion lasts a request's life in the simulator (`elder`, starvation `for_life`), takes its
program's first arrival as its place in the arrival order wherever a simulated request keeps its
arrival across its calls (`Policy.ranks_by_program_arrival`: every policy but those that requeue at
the tail when a call ends; the place a Nudge swap may have moved, and whether a swap moved it back
already, included), and carries a `ProgramOutlook`: the turns
its program is expected to have left (from the programs that ended: a turn with `retain: false`,
or a release), its reply length (the predicted one, or the program's mean so far) and its context
growth per turn (the program's mean).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from marsched.policy.program import ProgramLengths, ProgramOutlook
from marsched.policy.program_rest import RestRule
from marsched.policy.progress import RequestProgress

REMEMBERED = 100_000  # programs followed; the least recently seen is forgotten first


@dataclass(slots=True)
class ProgramRecord:
    turns: int = 0  # turns that arrived
    waited_iterations: int = 0
    waited_s: float = 0.0
    attained_iterations: int = 0
    output_tokens: int = 0  # generated over its ended turns
    ended_turns: int = 0
    first_context: int = 0  # the first turn's prompt
    last_context: int = 0  # the latest turn's prompt
    # Its place in the arrival order (the scheduler's clock): when its first turn arrived, or the
    # place a Nudge swap gave one of its turns (`policy/nudge.py`); and whether a swap moved it back.
    order_s: float = 0.0
    nudged: bool = False
    # Promoted for the rest of its life (starvation `for_life`): a simulated request stays promoted
    # over its later calls, and a program's calls are its turns here.
    elder: bool = False


class ProgramLedger:
    def __init__(self, limit: int = REMEMBERED, rest: RestRule = RestRule.MEAN,
                 program_arrival: bool = False) -> None:
        self._programs: OrderedDict[str, ProgramRecord] = OrderedDict()
        self._limit = limit
        self.lengths = ProgramLengths()
        # GITTINS: a turn's key is the Gittins rank over its program's turns left, as in the
        # simulator (`Policy.memory_time_form` with `RequestProgress.rest_counts`); MEAN: the mean.
        self.rest = rest
        # A turn's `order_s` is its program's first arrival (`Policy.ranks_by_program_arrival`).
        self.program_arrival = program_arrival

    def turn_arrives(self, conversation: str, progress: RequestProgress, predicted_tokens: int) -> None:
        """A turn of `conversation` arrives (its reply predicted at `predicted_tokens`): it takes
        over its program's clocks and gets its outlook. `progress.order_s` is the turn's arrival."""
        record = self._programs.pop(conversation, None) or ProgramRecord(first_context=progress.context_tokens,
                                                                         order_s=progress.order_s)
        self._programs[conversation] = record
        while len(self._programs) > self._limit:
            self._programs.popitem(last=False)
        record.turns += 1
        record.last_context = progress.context_tokens
        progress.waited_iterations += record.waited_iterations
        progress.waited_s += record.waited_s
        progress.attained_iterations += record.attained_iterations
        progress.attained_before_segment = progress.attained_iterations
        if self.program_arrival:
            progress.order_s = record.order_s
            progress.nudged = record.nudged
        progress.elder = record.elder
        progress.program = self._outlook(record, predicted_tokens)
        progress.rest_counts = self._counts(record)

    def adopt(self, conversation: str, prompt_tokens: int, arrival_s: float) -> None:
        """A request that arrived at `arrival_s` as no known program's turn (its conversation was
        not recognised then) ends as its program's first turn: from now on it is followed (`turn_ends`)."""
        if conversation not in self._programs:
            self._programs[conversation] = ProgramRecord(turns=1, first_context=prompt_tokens,
                                                         last_context=prompt_tokens, order_s=arrival_s)
            while len(self._programs) > self._limit:
                self._programs.popitem(last=False)

    def arrival(self, conversation: str) -> float | None:
        """The program's place in the arrival order (`ProgramRecord.order_s`); None if not followed."""
        record = self._programs.get(conversation)
        return None if record is None else record.order_s

    def turn_predicted(self, conversation: str, progress: RequestProgress, predicted_tokens: int) -> None:
        """A waiting turn's reply was predicted anew (told after it arrived): its outlook takes the number."""
        record = self._programs.get(conversation)
        if record is not None and progress.program is not None:
            progress.program = self._outlook(record, predicted_tokens)
            progress.rest_counts = self._counts(record)

    def _counts(self, record: ProgramRecord) -> list[tuple[int, float]] | None:
        """The turns-left distribution a Gittins rank is taken over, or None for the mean."""
        return self.lengths.turns_left_counts(record.turns) if self.rest is RestRule.GITTINS else None

    def _outlook(self, record: ProgramRecord, predicted_tokens: int) -> ProgramOutlook:
        """A turn's outlook: the program's mean reply once a turn ended (else the prediction), and its mean growth."""
        output = record.output_tokens / record.ended_turns if record.ended_turns else predicted_tokens
        growth = (record.last_context - record.first_context) / (record.turns - 1) if record.turns > 1 else output
        return ProgramOutlook(self.lengths.turns_left(record.turns), float(output), float(growth))

    def turn_ends(self, conversation: str, progress: RequestProgress, last: bool) -> None:
        """A turn ends: its program keeps what it waited and was served; a last turn ends the program."""
        record = self._programs.get(conversation)
        if record is None:
            return
        # A promoted turn was served as starving: its program's clock starts again.
        record.waited_iterations = 0 if progress.promoted else progress.waited_iterations
        record.waited_s = 0.0 if progress.promoted else progress.waited_s
        record.attained_iterations = progress.attained_iterations
        record.elder = progress.elder
        if self.program_arrival:  # a Nudge swap may have moved the turn's place while it waited
            record.order_s, record.nudged = progress.order_s, progress.nudged
        record.output_tokens += progress.generated
        record.ended_turns += 1
        if last:
            self.ended(conversation)

    def ended(self, conversation: str) -> None:
        """The program will send no more turns (its last turn, or a release)."""
        record = self._programs.pop(conversation, None)
        if record is not None:
            self.lengths.ended(record.turns)

    def snapshot(self) -> dict[str, float]:
        return {"programs_followed": len(self._programs), "programs_ended": len(self.lengths)}
