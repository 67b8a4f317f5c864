"""The engine's costs as the policies see them: iteration time, recompute time, swap time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Iteration time `c + a·tokens + b·context_tokens + d·sequences` under a token budget, and a host link.

    - `tokens`: new tokens computed in the iteration (prefill chunks plus one per decoding sequence);
      the matrix multiplications scale with them.
    - `context_tokens`: KV tokens that attention reads in the iteration, summed over the batch's
      sequences. A sequence with `k` tokens already computed that runs `n` new tokens reads `k + n`:
      the context before its chunk plus the chunk itself (a decode step reads its whole context,
      a first prefill chunk reads just itself). Decode attention is memory-bound on that read.
    - `sequences`: sequences scheduled in the iteration (a prefill chunk is one); the engine's
      per-sequence CPU work (scheduling, input preparation, sampling) scales with them.

    `b` and `d` default to 0, which is the linear profile `c + a·tokens` the simulator had first.
    Units: seconds and tokens of KV cache.
    """

    seconds_per_token: float  # a
    seconds_per_iteration: float  # c
    token_budget: int
    swap_tokens_per_s: float
    seconds_per_context_token: float = 0.0  # b
    seconds_per_sequence: float = 0.0  # d

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token budget must be >= 1, got {self.token_budget}")
        if self.swap_tokens_per_s <= 0:
            raise ValueError(f"swap bandwidth must be > 0 tokens/s, got {self.swap_tokens_per_s}")
        for name in ("seconds_per_context_token", "seconds_per_sequence"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def iteration_time(self, tokens: int, context_tokens: int = 0, sequences: int = 0) -> float:
        return (self.seconds_per_iteration + self.seconds_per_token * tokens
                + self.seconds_per_context_token * context_tokens + self.seconds_per_sequence * sequences)

    def recompute_time(self, tokens: int) -> float:
        """Tfwd: time to prefill `tokens` from an empty cache in budget-sized chunks, one per iteration."""
        return self.prefill_time(tokens)

    def prefill_time(self, tokens: int, computed: int = 0) -> float:
        """`tokens` prefilled in budget-sized chunks (one sequence per iteration) on `computed` cached tokens.

        Chunk `i` reads the context before it plus itself, its end position: with `m` full chunks of
        budget `B` and a rest `r`, the full chunks read `m·computed + B·m(m+1)/2` tokens in all and
        the rest reads `computed + m·B + r`.
        """
        full_chunks, rest = divmod(max(tokens, 0), self.token_budget)
        budget, computed = self.token_budget, max(computed, 0)
        time = full_chunks * self.iteration_time(budget, computed, 1)
        time += self.seconds_per_context_token * budget * full_chunks * (full_chunks + 1) / 2
        if rest:
            time += self.iteration_time(rest, computed + full_chunks * budget + rest, 1)
        return time

    def decode_time(self, context_tokens: int, steps: int, sequences: int = 1) -> float:
        """`steps` decode iterations of a batch of `sequences`, each reading `context_tokens` at the first.

        Every sequence's context grows by one token per step, so the reads grow by `sequences` per
        step and the total is an arithmetic series (what running identical iterations together sums).
        """
        if steps <= 0:
            return 0.0
        first = self.iteration_time(sequences, context_tokens, sequences)
        return steps * first + self.seconds_per_context_token * sequences * steps * (steps - 1) / 2

    def swap_time(self, tokens: int) -> float:
        """Tswap: time to move `tokens` of KV cache one way over the host link."""
        return max(tokens, 0) / self.swap_tokens_per_s

    @property
    def full_iteration_s(self) -> float:
        """An iteration of a full budget as one first chunk: the per-token cost, not the context read."""
        return self.iteration_time(self.token_budget, self.token_budget, 1)
