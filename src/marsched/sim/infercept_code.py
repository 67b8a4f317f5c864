"""The simulator running INFERCEPT as its published code schedules (policy `infercept-code`).

The formulas are in `policy/infercept_code.py`; this is the engine side of WukLab/InferCept@3a1a4da
`vllm/core/scheduler_v2.py` (`schedule`, `_schedule_chunk_and_fill`, `_schedule`,
`passive_discard_by_order`, `_active_discard`). Each iteration:

1. the swap budgets are set from the free device memory;
2. if nothing waits for a first prefill or a recompute, the oldest swapped request is turned
   into a recompute (one per iteration);
3. preserved calls are priced; the cheaper-to-discard ones are discarded but for the most
   expensive, which become swap-out targets;
4. three first-come-first-served passes build the batch under the token budget: running
   requests, then swapped ones, then waiting ones. A request short of blocks takes them by
   swapping blocks out from the tail of a victim, within the swap-out budget: the targets
   first, then (running pass only) a request delayed in this pass, then the last running
   request, then itself. A shortfall larger than the budget delays the request instead. With
   host memory full, fully swapped calls (longest remaining first) and then swapped requests
   are discarded to make room, and last the victim itself is recomputed.

A request whose blocks are partly on the host swaps them in within the swap-in budget and
computes only once all are back. Swaps are part of the iteration (the code overlaps them
with the forward pass layer by layer), so they take no link time here; the budgets are what
limit them; the swap-in budget is at least one block (see `_reconsider_paused`). Other
differences from the code, all of bookkeeping: the per-sequence-count limit
(dead in the code) is not modelled, and a request's prompt longer than the model's limit
cannot occur (traces are checked on loading).
"""

from __future__ import annotations

import math
from enum import Enum

from marsched.policy.infercept_code import (
    GPTJ_6B_SWAP_FIT, PausedWaste, SwapBudgetFit, SwapBudgets, chunked_discard_waste, discard_and_targets,
    recompute_chunk_tokens, swap_budgets,
)
from marsched.policy.progress import StrategyAssignment
from marsched.policy.strategy import Strategy
from marsched.sim.engine import Simulator
from marsched.sim.request import _QUEUE_OF_PHASE, Phase, SimRequest
from marsched.sim.memory import blocks_for


class _Admission(Enum):
    """What a swapped or waiting request's turn in its pass came to."""

    ADMITTED = "admitted"
    PASSED_OVER = "passed over"  # the targets could not make room: later requests are still tried
    STOP = "stop"  # short of blocks with no target or past the budget (or no tokens left): the pass ends


class InferceptCodeSimulator(Simulator):
    _runs_budgeted = True

    def __init__(self, *args, swap_fit: SwapBudgetFit = GPTJ_6B_SWAP_FIT, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.swap_fit = swap_fit
        self.swapped: list[SimRequest] = []  # call returned or preempted, KV (partly) on the host
        self.paused_swapped: dict[str, SimRequest] = {}  # inside a call, KV all on the host
        self.targets: list[SimRequest] = []  # preserved calls the next shortfall swaps out
        self.budgets = SwapBudgets(0, 0)
        self.swapped_in_blocks = 0
        self.swapped_out_blocks = 0

    # --- each iteration, before the batch ----------------------------------------------

    def _reconsider_paused(self) -> None:
        budgets = swap_budgets(self.device.free * self.block_tokens, self.cost.token_budget, self.block_tokens,
                               self.swap_fit)
        # At least a block in, so that KV on the host can always come back: GPT-J's fit never gives
        # less with its 64-token blocks, a profile with larger blocks could, and the engine would stall.
        self.budgets = SwapBudgets(max(budgets.in_blocks, 1), budgets.out_blocks)
        self._active_discard()
        self.targets = self._price_paused()

    def _active_discard(self) -> None:
        if len(self.queue) or not self.swapped:
            return
        oldest = min(self.swapped, key=lambda r: r.progress.order_s)
        self.swapped.remove(oldest)
        self._recompute(oldest)

    def _price_paused(self) -> list[SimRequest]:
        if not self.paused_preserved:
            return []
        chunk = recompute_chunk_tokens(self.cost.token_budget, sum(r.progress.pending_tokens for r in self.running))
        running_kv = sum(r.device_blocks for r in self.running) * self.block_tokens
        load = self.load()
        wastes = []
        for sim_request in self.paused_preserved.values():
            held = sim_request.device_blocks * self.block_tokens
            remaining_s = self.policy.remaining_call_s(sim_request.progress, load)
            wastes.append(PausedWaste(sim_request.rid, remaining_s * held,
                                      chunked_discard_waste(held, chunk, running_kv, self.cost)))
        discard, targets = discard_and_targets(wastes)
        for rid in discard:
            self._change_call_strategy(self.paused_preserved[rid], Strategy.DISCARD)
        return [self.paused_preserved[rid] for rid in targets]

    # --- the batch -----------------------------------------------------------------------

    def _build_batch(self) -> tuple[list[tuple[SimRequest, int]], bool]:
        batch = self._passes(self.budgets.out_blocks)
        if not batch and self._held_by_budget and self._seconds_to_next_event(to_horizon=False) is None:
            # Requests wait on the swap-out budget, nothing runs and nothing is due: the code would spin
            # for ever (a fit that allows fewer blocks out than a chunk needs). Lift it for this iteration.
            batch = self._passes(math.inf)
        # Identical iterations are never run together: prices and budgets change every iteration.
        return list(batch.values()), False

    def _passes(self, out_blocks: float) -> dict[str, tuple[SimRequest, int]]:
        self._budget = self.cost.token_budget
        self._in_left = self.budgets.in_blocks
        self._out_left = out_blocks
        self._held_by_budget = False  # some request was delayed because its shortfall exceeds the budget
        batch: dict[str, tuple[SimRequest, int]] = {}
        self._running_pass(batch)
        self._swapped_pass(batch)
        self._waiting_pass(batch)
        return batch

    def _running_pass(self, batch: dict[str, tuple[SimRequest, int]]) -> None:
        targets_left = sorted((r for r in self.running if r.phase is Phase.RUNNING), key=lambda r: r.progress.order_s)
        delayed: list[SimRequest] = []
        while targets_left and self._has_batch_room(batch):
            sim_request = targets_left.pop(0)
            swap_in, tokens = self._workload(sim_request)
            if swap_in == 0 and tokens == 0:
                delayed.append(sim_request)
                continue
            needed = self._blocks_needed(sim_request, swap_in, tokens)
            while needed > self.device.free:
                shortfall = needed - self.device.free
                if shortfall > self._out_left:
                    self._held_by_budget = True
                    delayed.append(sim_request)
                    break
                victims = self.targets or delayed or targets_left
                if victims:
                    self._out_left -= self._swap_out_from_tail(shortfall, victims)
                else:  # nobody else to take from: the request itself goes out whole
                    self._swap_out_from_tail(sim_request.device_blocks, [sim_request])
                    break
            else:
                self._schedule(batch, sim_request, swap_in, tokens)

    def _swapped_pass(self, batch: dict[str, tuple[SimRequest, int]]) -> None:
        # As in the code, `swapped` holds the requests not yet looked at while the pass runs: the one
        # being scheduled is not among those discarded to make room on the host.
        self.swapped.sort(key=lambda r: r.progress.order_s)
        delayed = []
        while self.swapped:
            sim_request = self.swapped.pop(0)
            swap_in, tokens = self._workload(sim_request)
            outcome = _Admission.PASSED_OVER if swap_in == tokens == 0 else self._admit(batch, sim_request, swap_in,
                                                                                        tokens)
            if outcome is not _Admission.ADMITTED:
                delayed.append(sim_request)
            if outcome is _Admission.STOP:
                break
        self.swapped.extend(delayed)

    def _waiting_pass(self, batch: dict[str, tuple[SimRequest, int]]) -> None:
        delayed = []
        while (progress := self.queue.pop(self.iteration, self.now)) is not None:
            sim_request = self.live[progress.request_id]
            tokens = min(progress.pending_tokens, self._budget)
            outcome = _Admission.STOP if tokens == 0 else self._admit(batch, sim_request, 0, tokens)
            if outcome is not _Admission.ADMITTED:
                delayed.append(sim_request)
            if outcome is _Admission.STOP:
                break
        if delayed:
            load = self.load()
            for sim_request in delayed:
                self.queue.push(sim_request.progress, load, self.iteration)

    def _admit(self, batch: dict[str, tuple[SimRequest, int]], sim_request: SimRequest, swap_in: int,
               tokens: int) -> _Admission:
        """A swapped or waiting request joins the running batch if its blocks are free or the targets
        can give them within the swap-out budget."""
        if not self._has_batch_room(batch):
            return _Admission.STOP
        needed = self._blocks_needed(sim_request, swap_in, tokens)
        if needed > self.device.free and (not self.targets or self._over_budget(needed)):
            return _Admission.STOP
        if not self._take_from_targets(needed):
            return _Admission.PASSED_OVER
        self._leave_queue(sim_request, tokens)
        sim_request.phase = Phase.RUNNING
        self.running.append(sim_request)
        self._schedule(batch, sim_request, swap_in, tokens)
        return _Admission.ADMITTED

    def _has_batch_room(self, batch: dict[str, tuple[SimRequest, int]]) -> bool:
        """The code caps the requests scheduled in an iteration, all three passes together, at
        max_num_seqs; a running request past the cap waits for the next iteration."""
        cap = self.profile.max_sequences
        return cap is None or len(batch) < cap

    def _over_budget(self, needed: int) -> bool:
        over = needed - self.device.free > self._out_left
        self._held_by_budget |= over
        return over

    def _take_from_targets(self, needed: int) -> bool:
        """Free `needed` device blocks from the targets within the swap-out budget; False if not."""
        while needed > self.device.free:
            if not self.targets or self._over_budget(needed):
                return False
            self._out_left -= self._swap_out_from_tail(needed - self.device.free, self.targets)
        return True

    def _workload(self, sim_request: SimRequest) -> tuple[int, int]:
        """(blocks to swap in, tokens to compute) this iteration: tokens only once the swap-in completes."""
        swap_in = min(self._in_left, sim_request.host_blocks)
        tokens = min(self._budget, sim_request.progress.pending_tokens) if swap_in == sim_request.host_blocks else 0
        return swap_in, tokens

    def _blocks_needed(self, sim_request: SimRequest, swap_in: int, tokens: int) -> int:
        table = sim_request.device_blocks + sim_request.host_blocks
        return swap_in + max(blocks_for(sim_request.progress.computed_tokens + tokens, self.block_tokens) - table, 0)

    def _schedule(self, batch: dict[str, tuple[SimRequest, int]], sim_request: SimRequest, swap_in: int,
                  tokens: int) -> None:
        if swap_in:
            self.host.release(swap_in)
            sim_request.host_blocks -= swap_in
            self.device.allocate(swap_in)
            sim_request.device_blocks += swap_in
            self._in_left -= swap_in
            self.swapped_in_blocks += swap_in
            self.lifecycle.swapped_in(sim_request, swap_in)
        if tokens:
            self._grow(sim_request, tokens)
            self._budget -= tokens
        batch[sim_request.rid] = (sim_request, tokens)  # tokens 0: in the batch only to swap in

    # --- eviction --------------------------------------------------------------------------

    def _swap_out_from_tail(self, blocks: int, victims: list[SimRequest]) -> int:
        """`passive_discard_by_order`: take `blocks` device blocks from the last victim onwards by
        moving them to the host; returns the blocks moved. A victim left with no device blocks
        leaves `victims` (swapped, or recomputed when the host has no room)."""
        moved = 0
        while blocks > 0 and victims:
            victim = victims[-1]
            take = min(victim.device_blocks, blocks)
            self._make_host_room(take)
            if self.host.free < take:
                blocks -= victim.device_blocks
                victims.pop()
                self._drop(victim)
                continue
            self.device.release(take)
            victim.device_blocks -= take
            self.host.allocate(take)
            victim.host_blocks += take
            blocks -= take
            moved += take
            self.swapped_out_blocks += take
            self.lifecycle.swapped_out(victim, take)
            if victim.device_blocks == 0:
                victims.pop()
                if victim.phase is Phase.PAUSED:
                    self._change_call_strategy(victim, Strategy.SWAP)
                else:
                    self._preempt_by_swap(victim)
        return moved

    def _make_host_room(self, blocks: int) -> None:
        """Host memory full: discard fully swapped calls (longest remaining call first), then swapped
        requests from the tail of their queue."""
        if self.host.free >= blocks:
            return  # the common case; building the load below walks the running batch
        load = self.load()
        while self.host.free < blocks:
            if self.paused_swapped:
                longest = max(self.paused_swapped.values(),
                              key=lambda r: self.policy.remaining_call_s(r.progress, load))
                self._change_call_strategy(longest, Strategy.DISCARD)
            elif self.swapped:
                self._recompute(self.swapped.pop())
            else:
                return

    def _drop(self, sim_request: SimRequest) -> None:
        """Recompute a victim the host has no room for."""
        if sim_request.phase is Phase.PAUSED:
            self._change_call_strategy(sim_request, Strategy.DISCARD)
        else:
            self.running.remove(sim_request)
            self._recompute(sim_request)

    def _preempt_by_swap(self, sim_request: SimRequest) -> None:
        """Preempted by swap once its last device block went out: its blocks are on the host."""
        self.running.remove(sim_request)
        sim_request.phase = Phase.SWAPPED
        self.swapped.append(sim_request)
        self.lifecycle.preempted(sim_request, sim_request.device_blocks + sim_request.host_blocks)

    def _recompute(self, sim_request: SimRequest) -> None:
        """Free all of a request's KV (device and host); it queues again for a full prefill."""
        self.device.release(sim_request.device_blocks)
        self.host.release(sim_request.host_blocks)
        self.lifecycle.preempted(sim_request, sim_request.device_blocks + sim_request.host_blocks)
        sim_request.device_blocks = sim_request.host_blocks = 0
        sim_request.progress.computed_tokens = 0
        sim_request.phase = Phase.WAITING
        self.queue.push(sim_request.progress, self.load(), self.iteration)

    # --- calls -------------------------------------------------------------------------------

    def _change_call_strategy(self, sim_request: SimRequest, strategy: Strategy) -> None:
        """A call's strategy changes while it runs: discarded (its KV freed on both sides) or, all
        its blocks now on the host, swapped."""
        progress = sim_request.progress
        self.paused_preserved.pop(sim_request.rid, None)
        self.paused_swapped.pop(sim_request.rid, None)
        if sim_request in self.targets:
            self.targets.remove(sim_request)
        remaining_s = self.policy.remaining_call_s(progress, self.load())
        progress.assign(StrategyAssignment(progress.segment_index, strategy, self.now, progress.computed_tokens,
                                           remaining_s, "reconsidered"))
        self.lifecycle.assignments(sim_request, len(progress.assignments) - 1, _QUEUE_OF_PHASE[sim_request.phase])
        sim_request.strategies[-1] = strategy.value
        if strategy is Strategy.DISCARD:
            self.device.release(sim_request.device_blocks)
            self.host.release(sim_request.host_blocks)
            sim_request.device_blocks = sim_request.host_blocks = 0
            progress.computed_tokens = 0
        else:
            self.paused_swapped[sim_request.rid] = sim_request

    def _return_call(self, sim_request: SimRequest) -> None:
        self.paused_swapped.pop(sim_request.rid, None)
        if sim_request in self.targets:
            self.targets.remove(sim_request)
        super()._return_call(sim_request)
        if sim_request.phase is Phase.SWAPPED:  # the swapped requests have their own first-come-first-served pass
            self.queue.remove(sim_request.rid, self.iteration, self.now)
            self.swapped.append(sim_request)
