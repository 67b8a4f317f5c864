"""What a freed request's KV leaves behind for its return: vLLM V1's prefix cache on the device
and, for `vllm-offload`, the host tier of prompt blocks (`prefix_cache.py` keeps the blocks).

A request that holds no blocks when it is admitted takes back its leading blocks still cached on
the device; past them, blocks stored on the host are loaded over the link before it computes.

Blocks are known by their content's owner (`SimRequest.kv_owner`): a request's own, or, for a
task of a conversation, the conversation's, so that the next task takes back what the previous
one left, up to the prompt the two share (`SimRequest.inherited_blocks`).
"""

from __future__ import annotations

from marsched.sim.request import Phase, SimRequest


class PrefixReuse:
    """Mixed into `Simulator`, which sets up `policy`, `device`, `host_tier`, `block_tokens`,
    `link_in`, `lifecycle`, `reused_blocks` and `carried_blocks`, and has `_admission_blocks`."""

    def _free_keeping_prefix(self, sim_request: SimRequest) -> None:
        """Free the request's device blocks; with a prefix cache its full ones keep their content."""
        if self.policy.prefix_cache:
            full = self._release_own(sim_request, sim_request.device_blocks)
            if self.host_tier is not None:  # what it computed of its prompt (vLLM offloads prompts only)
                self.host_tier.store(sim_request.kv_owner,
                                     min(full, self._prompt_tokens(sim_request) // self.block_tokens))
        else:
            self.device.release(sim_request.device_blocks)

    def _release_own(self, sim_request: SimRequest, blocks: int) -> int:
        """Free `blocks` of the request's device blocks, its full ones cached as its content (which
        is its own from then on); returns how many were full."""
        full = self._full_blocks(sim_request)
        self.device.release(blocks, sim_request.kv_owner, full)
        sim_request.inherited_blocks = None
        return full

    def _free_ended(self, sim_request: SimRequest) -> None:
        """Free an ended request's device blocks: with a prefix cache its full ones still go to the
        tail of the free queue (vLLM cannot know no one will ask for them). A conversation's task
        leaves them, and what it stored on the host, to the conversation's next task."""
        if sim_request.kv_owner != sim_request.rid:
            if self.policy.prefix_cache:
                self._release_own(sim_request, sim_request.device_blocks)
            else:
                self.device.release(sim_request.device_blocks)
            return
        if self.host_tier is not None:
            self.host_tier.retire(sim_request.rid)
        if self.policy.prefix_cache:
            self.device.queue.forget(sim_request.rid)
            self.device.release(sim_request.device_blocks, None, self._full_blocks(sim_request))
        else:
            self.device.release(sim_request.device_blocks)

    def _forget_past(self, owner: str, keep_tokens: int) -> None:
        """The client dropped `owner`'s context past `keep_tokens`: cached copies of it are stale."""
        if self.policy.prefix_cache:
            self.device.queue.truncate(owner, keep_tokens // self.block_tokens)
        if self.host_tier is not None:
            self.host_tier.truncate(owner, keep_tokens // self.block_tokens)

    def _full_blocks(self, sim_request: SimRequest) -> int:
        """The request's device blocks whose every token is computed (the ones a prefix cache keeps)."""
        return min(sim_request.progress.computed_tokens // self.block_tokens, sim_request.device_blocks)

    @staticmethod
    def _prompt_tokens(sim_request: SimRequest) -> int:
        """The prompt of the request stock vLLM runs now: the context its current segment started
        from (a request that leaves at each call comes back with the whole context as its prompt)."""
        return sim_request.progress.segment.context_tokens

    def _prefix_hit(self, sim_request: SimRequest) -> int:
        """Blocks a request that holds none takes back from the prefix cache: its leading blocks
        still cached, short of its last token, which is computed again for its logits (as vLLM's
        `get_computed_blocks` caps a hit)."""
        if not self.policy.prefix_cache or sim_request.device_blocks:
            return 0
        return min(self.device.queue.cached(sim_request.kv_owner), self._hit_limit(sim_request))

    def _host_hit(self, sim_request: SimRequest) -> int:
        """Leading blocks of a request that holds none stored in the host tier, short of its last token."""
        if self.host_tier is None or sim_request.device_blocks:
            return 0
        return min(self.host_tier.stored(sim_request.kv_owner), self._hit_limit(sim_request))

    def _hit_limit(self, sim_request: SimRequest) -> int:
        """The most blocks a hit serves: the context's full blocks short of its last token, and of
        a conversation's task that has freed nothing yet, the blocks it shares with the task before."""
        limit = (sim_request.progress.context_tokens - 1) // self.block_tokens
        inherited = sim_request.inherited_blocks
        return limit if inherited is None else min(limit, inherited)

    def _count_reuse(self, sim_request: SimRequest, blocks: int) -> None:
        self.reused_blocks += blocks
        if sim_request.inherited_blocks is not None:  # from the conversation's previous task
            self.carried_blocks += blocks

    def _take_device_hit(self, sim_request: SimRequest, blocks: int) -> None:
        """Admit the request onto its `blocks` leading blocks still cached on the device."""
        if blocks:
            self.device.take_back(sim_request.kv_owner, blocks)
            self._count_reuse(sim_request, blocks)
            sim_request.device_blocks = blocks
            sim_request.progress.computed_tokens = blocks * self.block_tokens

    def _start_prefix_load(self, sim_request: SimRequest, device_hit: int) -> bool:
        """Load the request's stored prefix past its device hit from the host, before it computes
        (vLLM's offloading loads a hit asynchronously and holds the request until it is in)."""
        blocks = self._host_hit(sim_request)
        if max(blocks, self._admission_blocks(sim_request, 0)) > self.device.free:
            return False
        if device_hit:
            self.device.take_back(sim_request.kv_owner, device_hit)
        self.device.allocate(blocks - device_hit)
        sim_request.device_blocks = blocks
        sim_request.progress.computed_tokens = blocks * self.block_tokens
        self._count_reuse(sim_request, blocks)
        self.lifecycle.admitted(sim_request, 0)
        sim_request.phase = Phase.SWAPPING_IN
        sim_request.transfer = self.link_in.start(sim_request, (blocks - device_hit) * self.block_tokens,
                                                  blocks - device_hit)
        return True
