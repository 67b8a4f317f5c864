"""The replay: every arrival's conversation, each a closed loop of turns, until all end or Ctrl-C.

A conversation waits for its arrival (and, under ``--max-concurrency``, for a free slot), then
sends its turns one after the other: the next turn goes out when the previous reply has ended
and the trace's gap (shaped by ``--gap-scale`` and ``--max-gap-s``) has passed. A turn that
fails ends its conversation (an agent whose model call fails does not carry on with the same
plan); the failure is in the turn's record. A subagent's conversation starts when its parent's
calling turn has ended. Ctrl-C (SIGINT) or SIGTERM stops every conversation where it is: what
had finished stays in the records, the turns in flight are dropped, and the result says it was
interrupted.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from marsched.loadgen.arrivals import Arrival
from marsched.loadgen.filler import GrowingContext
from marsched.loadgen.records import ConversationRecord, TurnRecord
from marsched.loadgen.session import GrownPrompt, shape_gap

# send(prompt, turn, conversation, last): fills `turn` (timing, usage, or its error); returns the
# reply's text. `last`: no turn of this conversation follows, as a client's final answer (one with
# no tool call) tells a server once the reply ends.
Send = Callable[[str, TurnRecord, str, bool], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class GapShape:
    scale: float = 1.0
    cap_s: float | None = None


@dataclass(slots=True)
class ReplayResult:
    conversations: list[ConversationRecord]
    wall_s: float
    interrupted: bool


async def run_conversation(arrival: Arrival, record: ConversationRecord, send: Send, gaps: GapShape,
                           clock0: float, on_turn: Callable[[int], None],
                           turn_ended: Callable[[int], None] = lambda index: None,
                           slots: asyncio.Semaphore | None = None) -> None:
    """Send `arrival`'s turns into `record`, starting at `record.arrival_s`. `on_turn(n)` counts turns
    done (or skipped after a failure); `turn_ended(i)` runs when turn i has ended well. With `slots`,
    the conversation holds one from its first turn to its end; one that waited for it arrives, in
    its record, when it got it (as `vllm bench --max-concurrency` times a request)."""
    await asyncio.sleep(max(0.0, clock0 + record.arrival_s - time.monotonic()))
    if slots is None:
        await _converse(arrival, record, send, gaps, clock0, on_turn, turn_ended)
        return
    async with slots:
        record.arrival_s = max(record.arrival_s, time.monotonic() - clock0)
        await _converse(arrival, record, send, gaps, clock0, on_turn, turn_ended)


async def _converse(arrival: Arrival, record: ConversationRecord, send: Send, gaps: GapShape, clock0: float,
                    on_turn: Callable[[int], None], turn_ended: Callable[[int], None]) -> None:
    record.started = True
    context = GrowingContext.for_conversation(arrival.conversation)
    turns = arrival.session.turns
    for index, turn in enumerate(turns):
        prompt = context.grow(turn.prompt) if isinstance(turn.prompt, GrownPrompt) else turn.prompt.text
        measured = TurnRecord(index, 0.0, turn.reply_tokens)
        reply = await send(prompt, measured, arrival.conversation, index + 1 == len(turns))
        record.turns.append(measured)
        if measured.error is not None:
            record.end_s = time.monotonic() - clock0
            on_turn(len(turns) - index)  # the rest will not be sent
            return
        context.add_reply(reply, measured.completion_tokens or turn.reply_tokens)
        on_turn(1)
        turn_ended(index)
        if index + 1 < len(turns):
            await asyncio.sleep(shape_gap(turn.gap_s, gaps.scale, gaps.cap_s))
    record.end_s = time.monotonic() - clock0


async def replay(arrivals: Sequence[Arrival], send: Send, gaps: GapShape = GapShape(),
                 on_turn: Callable[[int], None] = lambda n: None, clock0: float | None = None,
                 max_concurrency: int = 0) -> ReplayResult:
    """Run every arrival's conversation; returns when all have ended or on SIGINT/SIGTERM.

    A subagent's conversation (`Arrival.parent`) starts when its parent's calling turn has
    ended, and never if the parent fails before. With `max_concurrency` >= 1, at most that many
    conversations run at once; the others wait for one to end, in arrival order."""
    clock0 = time.monotonic() if clock0 is None else clock0
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency >= 1 else None
    records = [ConversationRecord(a.conversation, a.session.key, a.arrival_s, len(a.session.turns))
               for a in arrivals]
    children: dict[str, list[tuple[Arrival, ConversationRecord]]] = {}
    for arrival, record in zip(arrivals, records):
        if arrival.parent is not None:
            children.setdefault(arrival.parent, []).append((arrival, record))
    tasks: set[asyncio.Task] = set()

    def start(arrival: Arrival, record: ConversationRecord) -> None:
        def turn_ended(index: int) -> None:
            for child, child_record in children.get(arrival.conversation, ()):
                if child.parent_turn == index:
                    child_record.arrival_s = time.monotonic() - clock0
                    start(child, child_record)

        tasks.add(asyncio.create_task(run_conversation(arrival, record, send, gaps, clock0, on_turn, turn_ended,
                                                       slots)))

    for arrival, record in zip(arrivals, records):
        if arrival.parent is None:
            start(arrival, record)
    stop = asyncio.Event()
    handled = _handle_signals(stop)
    stopper = asyncio.create_task(stop.wait())
    interrupted = False
    try:
        # A conversation starts its subagents before it ends: once every task is done, none is left to start.
        while pending := {task for task in tasks if not task.done()}:
            await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                interrupted = True
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                break
        for task in tasks:  # a bug in a conversation is not a measurement: let it show
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
    finally:
        stopper.cancel()
        for signum in handled:
            asyncio.get_running_loop().remove_signal_handler(signum)
    return ReplayResult(records, time.monotonic() - clock0, interrupted)


def _handle_signals(stop: asyncio.Event) -> list[int]:
    loop = asyncio.get_running_loop()
    handled = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop.set)
            handled.append(signum)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    return handled
