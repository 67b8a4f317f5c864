"""Running an iteration of the simulator: its cost, identical decode iterations run in one go
(`stretch.py`), the clock's jumps to the next event, and the host link's transfers beside it."""

from __future__ import annotations

import math

from marsched.policy.cost_model import attention_pairs
from marsched.sim.request import Phase, SimRequest
from marsched.sim.stretch import (
    iterations_to_reach as _iterations_to_reach, series as _series, steps_in_blocks as _steps_in_blocks,
)


class IterationRun:
    """Mixed into `Simulator`, which sets up the pools, the links, the queue, the lifecycle and the clock."""


    def _run_batch(self, batch: list[tuple[SimRequest, int]], settled: bool) -> None:
        # A request that only swaps blocks in this iteration (n = 0) costs no compute. Attention
        # reads each sequence's cached context plus its new tokens (cost_model.py).
        computing = tokens = context_tokens = pairs = 0
        for r, n in batch:
            if n:
                cached = r.progress.computed_tokens
                computing += 1
                tokens += n
                context_tokens += cached + n
                pairs += attention_pairs(n, cached)
        dt = self.cost.iteration_time(tokens, context_tokens, computing, pairs)
        # Each decode iteration after the first reads one more token, one more pair, per sequence.
        growth = self.cost.decode_growth_s(computing)
        iterations = 1
        if settled and len(batch) == len(self.running) and all(
            r.progress.pending_tokens == 1 for r, _ in batch
        ):
            iterations = self._identical_iterations([r for r, _ in batch], dt, growth)
        span = _series(dt, growth, iterations)
        self.steps += 1
        end = self.now + span
        self.lifecycle.scheduled(iterations=iterations, batch=computing, tokens=tokens,
                                 context_tokens=context_tokens, free_blocks=self.device.free,
                                 host_free_blocks=self.host.free, dt_s=dt, span_s=span)
        finished_segment: list[SimRequest] = []
        for sim_request, n in batch:
            progress = sim_request.progress
            if iterations > 1:
                progress.computed_tokens += iterations - 1  # the first iteration's n=1 is added below
                progress.generated += iterations - 1
                progress.context_tokens += iterations - 1
                self._grow(sim_request, n)
            progress.computed_tokens += n
            if progress.computed_tokens == progress.context_tokens:
                progress.generated += 1
                progress.context_tokens += 1
                if math.isnan(sim_request.first_token_s):
                    sim_request.first_token_s = end
                if progress.generated >= progress.segment.output_tokens:
                    finished_segment.append(sim_request)
            self.queue.served(sim_request.rid, n + iterations - 1)
            progress.attained_iterations += iterations
        self.iteration += iterations
        self.tau.observe(dt, growth, iterations)
        self._advance_links(span)
        self.now = end
        for sim_request in finished_segment:
            self._end_segment(sim_request)

    def _identical_iterations(self, running: list[SimRequest], dt: float, growth: float) -> int:
        """How many decode-only iterations like this one (the first taking `dt`, each next `growth`
        longer) can run before anything changes."""
        limit = min(r.progress.segment.output_tokens - r.progress.generated for r in running)
        seconds = self._seconds_to_next_event()
        if seconds is not None:
            limit = min(limit, _iterations_to_reach(seconds, dt, growth))
        promotion = self.queue.iterations_to_next_promotion(self.iteration)
        if promotion is not None:
            limit = min(limit, promotion)
        if limit <= 1:
            return 1
        # Decode growth must fit in the free blocks; the first iteration's blocks are taken already.
        return _steps_in_blocks([(r.progress.computed_tokens, r.device_blocks) for r in running],
                                limit, self.device.free, self.block_tokens)

    def _seconds_to_next_event(self, to_horizon: bool = True) -> float | None:
        """Time from now to the next arrival, call return, transfer completion or promotion (seconds clock),
        or to the horizon of `run_until` when that comes first (unless `to_horizon` is false)."""
        times = []
        if self._next_arrival < len(self.pending):
            times.append(self.pending[self._next_arrival].arrival_s - self.now)
        if self._calls:
            times.append(self._calls[0][0] - self.now)
        for link in (self.link_out, self.link_in):
            seconds = link.seconds_to_next_completion()
            if seconds is not None:
                times.append(seconds)
        promotion = self.queue.seconds_to_next_promotion(self.now)
        if promotion is not None:
            times.append(promotion)
        if self.policy.releases_pins:  # a pin's time-to-live ends
            times.extend(self.policy.pin_expiry_s(h.progress) - self.now for h in self.paused_preserved.values())
        if to_horizon and self._horizon_s < math.inf:  # a cluster's next arrival, which may come here
            times.append(self._horizon_s - self.now)
        return max(min(times), 0.0) if times else None

    def _idle_until_next_event(self) -> None:
        seconds = self._seconds_to_next_event()
        if seconds is None:
            raise RuntimeError(
                f"simulation stalled at t={self.now:.3f}s: {len(self.queue)} queued, {len(self.running)} running, "
                f"{self.device.free}/{self.device.capacity} device blocks free"
            )
        self._advance_links(seconds)
        self.now += seconds

    def _advance_links(self, seconds: float) -> None:
        for transfer in self.link_out.advance(seconds):
            sim_request: SimRequest = transfer.owner
            sim_request.transfer = None
            blocks = sim_request.device_blocks
            if self.policy.prefix_cache:  # the freed blocks keep their content until handed out
                self._release_own(sim_request, blocks)
            else:
                self.device.release(blocks)
            self.lifecycle.swapped_out(sim_request, blocks, self.now + seconds)
            sim_request.device_blocks = 0
        for transfer in self.link_in.advance(seconds):
            transfer.owner.transfer = None
            self._swapped_in(transfer.owner, transfer.blocks, self.now + seconds)

    def _swapped_in(self, sim_request: SimRequest, copied_blocks: int, t: float) -> None:
        """Its blocks are all on the device: it runs. The host copy is dropped (a prefix load
        holds none: the host tier keeps its copy)."""
        self.host.release(sim_request.host_blocks)
        self.lifecycle.swapped_in(sim_request, copied_blocks, t)
        sim_request.host_blocks = 0
        sim_request.phase = Phase.RUNNING
        self.running.append(sim_request)
