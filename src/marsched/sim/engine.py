"""The discrete-event simulator: iteration-level continuous batching over paged KV memory.

Each iteration: arrivals and call returns that are due are taken in, the policy may
revisit preserved calls, starving requests are promoted, the queue's keys are
refreshed; then the batch is built under the token budget (running requests first,
preempting the lowest-ranked unprotected one when blocks run out; then queued
requests in the policy's order until one does not fit or the policy's admission rule
refuses it), and it runs for `c + a·tokens + b·context_tokens + d·sequences + e·attention_pairs`
seconds (the cost model's terms) while the host link moves swaps beside it.

When the next iteration is bound to be the same as this one (every running request
decoding, nothing admitted or preempted, no event due), the identical iterations up to the
next event run in one go (`stretch.py`); the result is the same as one at a time.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable

from marsched.lifecycle import CallLifecycle, IterationTime, choose_victim
from marsched.metrics.records import RequestRecord
from marsched.metrics.trace import EventTrace
from marsched.policy.admission import KvOutlook
from marsched.policy.compaction import cached_after_call
from marsched.policy.load import EngineLoad
from marsched.policy.policy import Policy, StrategyRule
from marsched.policy.progress import RequestProgress
from marsched.policy.queue import WaitingQueue
from marsched.sim.invariants import check_invariants
from marsched.sim.iteration import IterationRun
from marsched.sim.request import Phase, SimRequest, SimResult, finished_record
from marsched.sim.spawns import HeldSpawns
from marsched.sim.link import HostLink
from marsched.sim.memory import BlockPool, blocks_for, check_fits
from marsched.sim.prefix_cache import CachingBlockPool, HostPrefixTier
from marsched.sim.prefix_reuse import PrefixReuse
from marsched.sim.profile import Profile
from marsched.workload.model import Request


StepHook = Callable[["Simulator"], None]


class Simulator(PrefixReuse, IterationRun):
    _runs_budgeted = False  # whether this engine runs INFERCEPT's code (`StrategyRule.BUDGETED`)

    def __init__(
        self,
        requests: list[Request],
        profile: Profile,
        policy: Policy,
        trace: EventTrace | None = None,
        on_step: StepHook | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        queued_turns: bool = False,
    ) -> None:
        if policy.rule is StrategyRule.BUDGETED and not self._runs_budgeted:
            raise ValueError(f"policy {policy.name!r} runs on its own engine: build it with sim.select.make_simulator")
        self.profile = profile
        self.policy = policy
        self.cost = policy.cost
        self.block_tokens = profile.block_tokens
        self.trace = trace or EventTrace()
        self.on_step = on_step
        self.on_progress = on_progress
        self.device = (CachingBlockPool if policy.prefix_cache else BlockPool)("device", profile.device_blocks)
        self.host = BlockPool("host", profile.host_blocks)
        self.host_tier = HostPrefixTier(profile.host_blocks) if policy.offload else None
        self.link_out = HostLink(self.cost.swap_tokens_per_s)
        self.link_in = HostLink(self.cost.swap_tokens_per_s)
        self.queue = WaitingQueue(policy)
        check_fits(requests, profile)
        self.spawns = HeldSpawns(requests)  # subagents arrive when their parent's call starts
        self.pending = sorted(self.spawns.roots(requests), key=lambda r: r.arrival_s)
        self._total = len(requests)
        self.live: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self._calls: list[tuple[float, int, SimRequest]] = []  # heap of (api end, seq, request)
        self._sequence = 0
        self.records: list[RequestRecord] = []
        self.now = 0.0
        self.iteration = 0
        self.steps = 0
        self._next_arrival = 0
        self.tau = IterationTime(self.cost)
        self.lifecycle = CallLifecycle(policy, self.queue, self, self.trace, handle_of=self.live.__getitem__)
        self._horizon_s = math.inf
        self._joined_after_batch = False  # a swap-in with nothing to copy ran after the batch was built
        self._started_t = time.perf_counter()
        self.reused_blocks = 0  # prefix and host hits
        self.carried_blocks = 0  # the part of them a task took from its conversation's previous task
        self.shared_blocks = 0  # the full blocks tasks' prompts share with their conversation's previous task
        # Each call's return comes back as a new request, as a client running its own tools sends its
        # next turn over HTTP: a follow-up whose KV stayed on the device waits in the queue like any
        # turn, holding its blocks (`marsched serve`'s kept turn claimed by its follow-up), instead of
        # rejoining the batch as a resumable request does inside vLLM.
        self.queued_turns = queued_turns
        self.held: dict[str, tuple[float, SimRequest]] = {}  # such follow-ups: (kept since, request)
        self.yielded_turns = 0  # held follow-ups that gave their blocks up for the queue's head

    @property
    def paused_preserved(self) -> dict[str, SimRequest]:
        """Preserved calls the policy revisits (the lifecycle's)."""
        return self.lifecycle.paused_preserved

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> SimResult:
        self.start()
        self.run_until(math.inf)
        return self.finish()

    # A replica of a cluster (`cluster.py`) runs in pieces instead: start, then run_until each
    # arrival's time and inject the requests routed to it, then run_until(inf) and finish.

    def start(self) -> None:
        self._started_t = time.perf_counter()
        self.lifecycle.run_started("sim", self.device.capacity, self.host.capacity, self.block_tokens)

    def run_until(self, horizon_s: float) -> None:
        """Run iterations until every request known so far has ended or the clock reaches
        `horizon_s` (the iteration running then ends past it); an engine with nothing to do
        waits there. Nothing bunches identical iterations past the horizon, where an arrival
        this engine does not know of yet may come."""
        self._horizon_s = horizon_s
        total = self._total
        while len(self.records) < total and self.now < horizon_s:
            self._take_arrivals()
            self._take_returns()
            if len(self.records) == total:
                break  # the last request ended with a call that just returned
            self._reconsider_paused()
            self.lifecycle.promote_starving()
            self.queue.refresh(self.load(), self.iteration)
            self._joined_after_batch = False
            batch, settled = self._build_batch()
            if batch:
                self._run_batch(batch, settled)
            elif not self._joined_after_batch:  # else it runs in the next iteration, at this time
                self._idle_until_next_event()
            if self.on_step:
                self.on_step(self)
            if self.on_progress:
                self.on_progress(len(self.records), total)
        if self.now < horizon_s < math.inf:
            self._advance_links(horizon_s - self.now)
            self.now = horizon_s

    def inject(self, requests: list[Request]) -> None:
        """More requests for this engine: a routed arrival, with the subagents its calls start."""
        check_fits(requests, self.profile)
        self.spawns.held.update(HeldSpawns(requests).held)
        for request in self.spawns.roots(requests):
            bisect.insort(self.pending, request, lo=self._next_arrival, key=lambda r: r.arrival_s)
        self._total += len(requests)

    @property
    def unfinished(self) -> int:
        """Requests given to this engine that have not ended."""
        return self._total - len(self.records)

    def finish(self) -> SimResult:
        self.lifecycle.ended(len(self.records))
        return SimResult(self.records, self.iteration, self.steps, self.now, time.perf_counter() - self._started_t,
                         self.reused_blocks, self.carried_blocks, self.shared_blocks)

    def load(self) -> EngineLoad:
        return EngineLoad(
            now_s=self.now,
            running_kv_tokens=sum(r.progress.computed_tokens for r in self.running),
            iteration_s=self.tau.seconds,
            host_free_tokens=self.host.free * self.block_tokens,
            kv_capacity_tokens=self.device.capacity * self.block_tokens,
        )

    # --- what the lifecycle driver asks of the engine (`lifecycle.EngineSide`) ----------

    def clock(self) -> float:
        return self.now

    def current_iteration(self) -> int:
        return self.iteration

    def kv_blocks_in_use(self) -> tuple[int, int]:
        return self.device.used, self.host.used

    def can_swap(self, sim_request: SimRequest) -> bool:
        return self.host.free >= sim_request.device_blocks

    def keep(self, sim_request: SimRequest) -> None:
        pass  # the blocks stay where they are

    def discard(self, sim_request: SimRequest) -> None:
        self._free_keeping_prefix(sim_request)
        sim_request.device_blocks = 0
        sim_request.progress.computed_tokens = 0

    def swap_out(self, sim_request: SimRequest) -> None:
        self.host.allocate(sim_request.device_blocks)
        sim_request.host_blocks = sim_request.device_blocks
        sim_request.transfer = self.link_out.start(sim_request, sim_request.progress.computed_tokens,
                                                   sim_request.device_blocks)

    def holds_preserved(self, sim_request: SimRequest) -> bool:
        return True  # a preserved call leaves the revisited set only through the lifecycle

    # --- events -----------------------------------------------------------------------

    def _take_arrivals(self) -> None:
        while self._next_arrival < len(self.pending) and self.pending[self._next_arrival].arrival_s <= self.now:
            request = self.pending[self._next_arrival]
            self._next_arrival += 1
            progress = RequestProgress(request, order_s=request.arrival_s)
            sim_request = SimRequest(progress, wait_since_s=self.now)
            if request.conversation:  # what it may take of its conversation's cached blocks
                shared = request.follows.shared_tokens if request.follows is not None else 0
                sim_request.inherited_blocks = shared // self.block_tokens
                self.shared_blocks += sim_request.inherited_blocks
            self.live[request.request_id] = sim_request
            self.lifecycle.arrived(sim_request, request.arrival_s, request.prompt_tokens)
            self.lifecycle.start_segment(sim_request, "waiting")
            self.queue.push(progress, self.load(), self.iteration)

    def _take_returns(self) -> None:
        while self._calls and self._calls[0][0] <= self.now:
            _, _, sim_request = heapq.heappop(self._calls)
            self._return_call(sim_request)

    def _return_call(self, sim_request: SimRequest) -> None:
        progress = sim_request.progress
        call = progress.segment.api
        kept_since = progress.api_started_s
        if sim_request.transfer is not None:
            # Still being copied out: the device copy is intact, so keep it and drop the host one.
            self.link_out.cancel(sim_request.transfer)
            sim_request.transfer = None
            self.host.release(sim_request.host_blocks)
            sim_request.host_blocks = 0
        self.lifecycle.call_returned(sim_request, call, call.return_tokens)
        if progress.in_last_segment:
            self._finish(sim_request)
            return
        if self.queued_turns:
            self._keep_full_blocks(sim_request)
        self.lifecycle.begin_next_segment(sim_request)
        progress.context_tokens = call.next_context(progress.context_tokens)
        if call.compacts:
            self._drop_compacted(sim_request, cached_after_call(progress.computed_tokens, call.kept_tokens,
                                                                progress.context_tokens))
            # The freed copies of the context keep their content up to the kept prefix, whatever
            # the request still holds (stock vLLM holds none at a call, yet hits its prefix).
            self._forget_past(sim_request.kv_owner, call.kept_tokens)
        self.lifecycle.start_segment(sim_request, "paused")
        if sim_request.device_blocks and self.queued_turns:
            where = "waiting"
            sim_request.phase = Phase.WAITING
            self.held[sim_request.rid] = (kept_since, sim_request)
        elif sim_request.device_blocks:
            where = "device"
            sim_request.phase = Phase.RUNNING
            self.running.append(sim_request)
        else:
            where = "host" if sim_request.host_blocks else "waiting"
            sim_request.phase = Phase.SWAPPED if sim_request.host_blocks else Phase.WAITING
        self.lifecycle.resumed(sim_request, where)
        if where != "device":
            self.queue.push(progress, self.load(), self.iteration)

    def _keep_full_blocks(self, sim_request: SimRequest) -> None:
        """A follow-up over HTTP finds its turn's full blocks kept, not the last, partial one
        (`marsched serve` pins or copies full blocks, `vllm/retention.py`): it computes that again."""
        if sim_request.device_blocks or sim_request.host_blocks:
            full = sim_request.progress.computed_tokens // self.block_tokens
            self._drop_compacted(sim_request, full * self.block_tokens)

    def _drop_compacted(self, sim_request: SimRequest, keep_tokens: int) -> None:
        """The KV past `keep_tokens` is freed, from the tail (host blocks first: a swap moves a
        request's tail out first): the client compacted the context, or a follow-up over HTTP
        finds only its turn's full blocks kept (`_keep_full_blocks`)."""
        drop = sim_request.device_blocks + sim_request.host_blocks - blocks_for(keep_tokens, self.block_tokens)
        from_host = min(max(drop, 0), sim_request.host_blocks)
        self.host.release(from_host)
        sim_request.host_blocks -= from_host
        from_device = max(drop - from_host, 0)
        self.device.release(from_device)
        sim_request.device_blocks -= from_device
        sim_request.progress.computed_tokens = min(sim_request.progress.computed_tokens, keep_tokens)

    def _reconsider_paused(self) -> None:
        self.lifecycle.reconsider_paused()

    # --- scheduling -------------------------------------------------------------------

    def _build_batch(self) -> tuple[list[tuple[SimRequest, int]], bool]:
        """The iteration's batch as (request, tokens); `settled` if nothing was admitted or preempted."""
        budget = self.cost.token_budget
        batch: dict[str, tuple[SimRequest, int]] = {}
        preempted = False
        for sim_request in list(self.running):
            if sim_request.phase is not Phase.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            tokens = min(sim_request.progress.pending_tokens, budget)
            while not self._fits(sim_request, tokens):
                if self.policy.releases_pins and self.lifecycle.release_pinned():
                    continue
                # Held follow-ups give way before anything running is preempted, as pins do (as
                # `marsched serve`'s do inside vLLM's allocation).
                needed = blocks_for(sim_request.progress.computed_tokens + tokens, self.block_tokens)
                if self._yield_held(needed - sim_request.device_blocks, sim_request):
                    continue
                victim = self._victim(sim_request)
                preempted = True
                if victim.rid in batch:
                    budget += batch.pop(victim.rid)[1]
                self._preempt(victim, requester=sim_request)
                if victim is sim_request:
                    break
            if sim_request.phase is not Phase.RUNNING:
                continue
            self._grow(sim_request, tokens)
            batch[sim_request.rid] = (sim_request, tokens)
            budget -= tokens
        admitted = False
        if not preempted:
            admitted = self._admit_from_queue(batch, budget)
        return list(batch.values()), not (preempted or admitted)

    def _admit_from_queue(self, batch: dict[str, tuple[SimRequest, int]], budget: int) -> bool:
        admitted = False
        outlooks: list[KvOutlook] = []  # the running requests', built once for this step's candidates
        while budget > 0 and self._has_sequence_room():
            progress = self.queue.pop(self.iteration, self.now)
            if progress is None:
                break
            sim_request = self.live[progress.request_id]
            if not self._admissible(sim_request, outlooks):
                self.queue.push_back(progress)
                break
            if sim_request.phase is Phase.SWAPPED:
                started = self._start_swap_in(sim_request) or (
                    self._yield_held(sim_request.host_blocks, sim_request) and self._start_swap_in(sim_request))
                if not started:
                    self.queue.push_back(progress)
                    break
                admitted = True
                continue
            if sim_request.rid in self.held:
                if not self._admit_held(sim_request, batch, budget):
                    self.queue.push_back(progress)
                    break
                budget -= batch[sim_request.rid][1]
                admitted = True
                continue
            hit = self._prefix_hit(sim_request)
            tokens = min(progress.context_tokens - hit * self.block_tokens - progress.computed_tokens, budget)
            needed = self._admission_blocks(sim_request, hit * self.block_tokens + tokens)
            fits = needed <= self.device.free
            while not fits and self.policy.releases_pins and self.lifecycle.release_pinned():
                fits = needed <= self.device.free
            if not fits and self._yield_held(needed, sim_request):
                # The yielded blocks may have been its own conversation's: look again.
                hit = self._prefix_hit(sim_request)
                tokens = min(progress.context_tokens - hit * self.block_tokens - progress.computed_tokens, budget)
                fits = self._admission_blocks(sim_request, hit * self.block_tokens + tokens) <= self.device.free
            if not fits:
                self.queue.push_back(progress)
                break
            if self._host_hit(sim_request) > hit:
                started = self._start_prefix_load(sim_request, hit) or (
                    self._yield_held(self._host_hit(sim_request), sim_request)
                    and self._start_prefix_load(sim_request, self._prefix_hit(sim_request)))
                if not started:
                    self.queue.push_back(progress)
                    break
                admitted = True
                continue
            self._take_device_hit(sim_request, hit)
            self._grow(sim_request, tokens)
            self._leave_queue(sim_request, tokens)
            sim_request.phase = Phase.RUNNING
            self.running.append(sim_request)
            batch[sim_request.rid] = (sim_request, tokens)
            budget -= tokens
            admitted = True
        return admitted

    def _admit_held(self, sim_request: SimRequest, batch: dict[str, tuple[SimRequest, int]], budget: int) -> bool:
        """A follow-up holding its kept blocks joins the batch, computing only past them; False when
        its chunk does not fit even after pins and other held follow-ups gave way."""
        tokens = min(sim_request.progress.pending_tokens, budget)
        needed = self._admission_blocks(sim_request, sim_request.progress.computed_tokens + tokens) \
            - sim_request.device_blocks
        fits = needed <= self.device.free
        while not fits and self.policy.releases_pins and self.lifecycle.release_pinned():
            fits = needed <= self.device.free
        if not fits:
            self._yield_held(needed, sim_request)
            fits = needed <= self.device.free
        if not fits:
            return False
        del self.held[sim_request.rid]
        self._grow(sim_request, tokens)
        self._leave_queue(sim_request, tokens)
        sim_request.phase = Phase.RUNNING
        self.running.append(sim_request)
        batch[sim_request.rid] = (sim_request, tokens)
        return True

    def _yield_held(self, needed_blocks: int, head: SimRequest) -> bool:
        """`head` needs `needed_blocks` free: other follow-ups waiting with their kept blocks give
        them up, the longest kept first, as `marsched serve` unpins them (`ConversationKeeper.relieve`);
        their blocks stay in the prefix cache. Whether any did."""
        yielded = False
        for rid, (_, held) in sorted(self.held.items(), key=lambda item: item[1][0]):
            if self.device.free >= needed_blocks:
                break
            if held is head:
                continue
            del self.held[rid]
            self._free_keeping_prefix(held)
            held.device_blocks = 0
            held.progress.computed_tokens = 0
            self.yielded_turns += 1
            yielded = True
        return yielded

    def _has_sequence_room(self) -> bool:
        """Whether the profile's cap on running requests (vLLM's max_num_seqs) lets one more in. A
        request being swapped in counts: it runs once its blocks are back. A preserved call that
        returns rejoins the batch without asking, so the batch can exceed the cap until one ends."""
        cap = self.profile.max_sequences
        return cap is None or len(self.running) + len(self.link_in) < cap

    def _admissible(self, sim_request: SimRequest, outlooks: list[KvOutlook] | None = None) -> bool:
        """The policy's admission rule, given the running batch and the KV held outside it.
        `outlooks`: the running requests' KV outlooks as far as known (extended here)."""
        if not self.policy.looks_at_batch(bool(self.running)):
            return True  # no outlook to build
        outlooks = [] if outlooks is None else outlooks
        outlooks.extend(self.policy.kv_outlook(r.progress) for r in self.running[len(outlooks):])
        other_tokens = (self.device.used - sum(r.device_blocks for r in self.running)) * self.block_tokens
        return self.policy.admits_outlooks(self.policy.kv_outlook(sim_request.progress), outlooks, other_tokens,
                                           self.device.capacity * self.block_tokens, self.block_tokens)

    def _leave_queue(self, sim_request: SimRequest, prefill_tokens: int) -> None:
        self.lifecycle.admitted(sim_request, prefill_tokens)

    def _admission_blocks(self, sim_request: SimRequest, chunk_end_tokens: int) -> int:
        """The blocks a waiting request must find to be admitted with its context computed up to
        `chunk_end_tokens`: with the profile's `admits_whole_prompt`, those of its whole context (vLLM's
        `scheduler_reserve_full_isl`; its later chunks then grow as a running request's do)."""
        if self.profile.admits_whole_prompt:
            chunk_end_tokens = max(chunk_end_tokens, sim_request.progress.context_tokens)
        return blocks_for(chunk_end_tokens, self.block_tokens)

    def _fits(self, sim_request: SimRequest, tokens: int) -> bool:
        needed = blocks_for(sim_request.progress.computed_tokens + tokens, self.block_tokens) - sim_request.device_blocks
        return needed <= self.device.free

    def _grow(self, sim_request: SimRequest, tokens: int) -> None:
        needed = blocks_for(sim_request.progress.computed_tokens + tokens, self.block_tokens) - sim_request.device_blocks
        if needed > 0:
            self.device.allocate(needed)
            sim_request.device_blocks += needed

    def _victim(self, requester: SimRequest) -> SimRequest:
        load, policy = self.load(), self.policy
        return choose_victim((r for r in self.running if r.phase is Phase.RUNNING), requester,
                             lambda r: policy.is_protected(r.progress, self.iteration),
                             lambda r: policy.victim_key(r.progress, load))

    def _preempt(self, sim_request: SimRequest, requester: SimRequest | None = None) -> None:
        progress = sim_request.progress
        self._free_keeping_prefix(sim_request)
        self.lifecycle.preempted(sim_request, sim_request.device_blocks, requester)
        sim_request.device_blocks = 0
        progress.computed_tokens = 0
        sim_request.phase = Phase.WAITING
        self.running.remove(sim_request)
        self.queue.push(progress, self.load(), self.iteration)

    def _start_swap_in(self, sim_request: SimRequest) -> bool:
        """Bring a swapped request back: its leading blocks still cached on the device are taken
        back and only the rest is copied in (as the Swap connector loads only past a local prefix
        hit, `kv_swap.HostSwapConnector.update_state_after_alloc`)."""
        blocks = sim_request.host_blocks
        if max(blocks, self._admission_blocks(sim_request, 0)) > self.device.free:  # cached blocks are free too
            return False
        hit = min(self._prefix_hit(sim_request), blocks)
        if hit:
            self.device.take_back(sim_request.kv_owner, hit)
            self._count_reuse(sim_request, hit)
        self.device.allocate(blocks - hit)
        sim_request.device_blocks = blocks
        self._leave_queue(sim_request, 0)
        if hit == blocks:  # all of it still on the device: nothing to copy
            self._swapped_in(sim_request, 0, self.now)
            self._joined_after_batch = True  # running, but not in the batch already built
            return True
        sim_request.phase = Phase.SWAPPING_IN
        sim_request.transfer = self.link_in.start(
            sim_request, sim_request.progress.computed_tokens - hit * self.block_tokens, blocks - hit)
        return True

    # --- calls and completion ---------------------------------------------------------

    def _end_segment(self, sim_request: SimRequest) -> None:
        progress = sim_request.progress
        self.running.remove(sim_request)
        call = progress.segment.api
        if call is None:
            self._finish(sim_request)
            return
        sim_request.api_end_s = self.now + call.duration_s
        sim_request.phase = Phase.PAUSED
        for child in self.spawns.release(sim_request.rid, progress.segment_index, self.now):
            bisect.insort(self.pending, child, key=lambda r: r.arrival_s)  # after those due by now
        if progress.in_last_segment:
            self._start_trailing_call(sim_request)
            return
        # The context before a Discard frees it.
        self.lifecycle.start_call(sim_request, progress.computed_tokens, call.duration_s)
        self._sequence += 1
        heapq.heappush(self._calls, (sim_request.api_end_s, self._sequence, sim_request))

    def _start_trailing_call(self, sim_request: SimRequest) -> None:
        """The last segment's call: nothing is computed after it, so its KV is freed now."""
        progress = sim_request.progress
        self._free_ended(sim_request)
        sim_request.device_blocks = 0
        progress.computed_tokens = 0
        self.lifecycle.start_trailing_call(sim_request, progress.context_tokens, progress.segment.api.duration_s)
        self._sequence += 1
        heapq.heappush(self._calls, (sim_request.api_end_s, self._sequence, sim_request))

    def _finish(self, sim_request: SimRequest) -> None:
        progress = sim_request.progress
        request = progress.request
        self._free_ended(sim_request)
        sim_request.device_blocks = 0
        sim_request.phase = Phase.FINISHED
        sim_request.finish_s = self.now
        del self.live[sim_request.rid]
        self.queue.finished(sim_request.rid)
        record = finished_record(sim_request, self.cost)
        self.records.append(record)
        self.lifecycle.finished(sim_request, record.e2e_s, record.ttft_s)

    # --- invariants (for tests and audits) ------------------------------------------

    def check_invariants(self) -> None:
        check_invariants(self)
