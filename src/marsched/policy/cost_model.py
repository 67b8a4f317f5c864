"""The engine's costs as the policies see them: iteration time, recompute time, swap time."""

from __future__ import annotations

from dataclasses import dataclass


def attention_pairs(new_tokens: int, cached_tokens: int) -> int:
    """(query, key) pairs causal attention computes for `new_tokens` on `cached_tokens` already cached.

    New token i (0-based) attends to the cached tokens, the new ones before it and itself:
    `cached + i + 1` keys. Summed over i: `n·k + n(n+1)/2`. A decode step (n = 1) makes `k + 1`
    pairs, its context read. The sum does not depend on how the n tokens are cut into chunks:
    prefilling T tokens on k cached ones makes `T·k + T(T+1)/2` pairs in any chunking.
    """
    n, k = max(new_tokens, 0), max(cached_tokens, 0)
    return n * k + n * (n + 1) // 2


@dataclass(frozen=True, slots=True)
class CostModel:
    """Iteration time `c + a·tokens + b·context_tokens + e·attention_pairs + d·sequences` under a token
    budget, and a host link.

    - `tokens`: new tokens computed in the iteration (prefill chunks plus one per decoding sequence);
      the matrix multiplications scale with them.
    - `context_tokens`: KV tokens that attention reads in the iteration, summed over the batch's
      sequences. A sequence with `k` tokens already computed that runs `n` new tokens reads `k + n`:
      the context before its chunk plus the chunk itself (a decode step reads its whole context,
      a first prefill chunk reads just itself). Decode attention is memory-bound on that read.
    - `attention_pairs`: (new token, context token) pairs attention computes, summed over the batch
      (`attention_pairs(n, k)` for a sequence running n new tokens on k cached). Prefill attention
      is compute-bound on them: a chunk of n tokens at k cached pays `e·(n·k + n(n+1)/2)`, which
      dominates `b·(k + n)` at long contexts.
    - `sequences`: sequences scheduled in the iteration (a prefill chunk is one); the engine's
      per-sequence CPU work (scheduling, input preparation, sampling) scales with them.

    `b`, `e` and `d` default to 0, which is the linear profile `c + a·tokens` the simulator had first.
    Units: seconds and tokens of KV cache.
    """

    seconds_per_token: float  # a
    seconds_per_iteration: float  # c
    token_budget: int
    swap_tokens_per_s: float
    seconds_per_context_token: float = 0.0  # b
    seconds_per_sequence: float = 0.0  # d
    seconds_per_attention_pair: float = 0.0  # e

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token budget must be >= 1, got {self.token_budget}")
        if self.swap_tokens_per_s <= 0:
            raise ValueError(f"swap bandwidth must be > 0 tokens/s, got {self.swap_tokens_per_s}")
        for name in ("seconds_per_context_token", "seconds_per_sequence", "seconds_per_attention_pair"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def iteration_time(self, tokens: int, context_tokens: int = 0, sequences: int = 0, attention_pairs: int = 0) -> float:
        return (self.seconds_per_iteration + self.seconds_per_token * tokens
                + self.seconds_per_context_token * context_tokens + self.seconds_per_sequence * sequences
                + self.seconds_per_attention_pair * attention_pairs)

    def recompute_time(self, tokens: int) -> float:
        """Tfwd: time to prefill `tokens` from an empty cache in budget-sized chunks, one per iteration."""
        return self.prefill_time(tokens)

    def prefill_time(self, tokens: int, computed: int = 0) -> float:
        """`tokens` prefilled in budget-sized chunks (one sequence per iteration) on `computed` cached tokens.

        Chunk `i` reads the context before it plus itself, its end position: with `m` full chunks of
        budget `B` and a rest `r`, the full chunks read `m·computed + B·m(m+1)/2` tokens in all and
        the rest reads `computed + m·B + r`. The attention pairs of all chunks together are those of
        the T tokens at once, `T·computed + T(T+1)/2` (`attention_pairs`), whatever the chunking.
        """
        tokens, computed = max(tokens, 0), max(computed, 0)
        full_chunks, rest = divmod(tokens, self.token_budget)
        budget = self.token_budget
        time = full_chunks * self.iteration_time(budget, computed, 1)
        time += self.seconds_per_context_token * budget * full_chunks * (full_chunks + 1) / 2
        if rest:
            time += self.iteration_time(rest, computed + full_chunks * budget + rest, 1)
        return time + self.seconds_per_attention_pair * attention_pairs(tokens, computed)

    def cached_attention_time(self, tokens: int, cached: int) -> float:
        """The attention pairs `tokens` new tokens make with `cached` tokens already cached, `e·n·k`:
        what a prefill on a cached context pays beyond the same prefill from an empty cache."""
        return self.seconds_per_attention_pair * max(tokens, 0) * max(cached, 0)

    def decode_time(self, context_tokens: int, steps: int, sequences: int = 1) -> float:
        """`steps` decode iterations of a batch of `sequences`, each reading `context_tokens` at the first.

        Every sequence's context grows by one token per step, so the reads grow by `sequences` per
        step and the total is an arithmetic series (what running identical iterations together sums).
        A decode token's attention pairs are its context read, so they grow alike.
        """
        if steps <= 0:
            return 0.0
        first = self.iteration_time(sequences, context_tokens, sequences, context_tokens)
        return steps * first + self.decode_growth_s(sequences) * steps * (steps - 1) / 2

    def decode_growth_s(self, sequences: int) -> float:
        """How much longer each decode iteration of `sequences` is than the one before: one more
        context token read, and one more attention pair, per sequence."""
        return (self.seconds_per_context_token + self.seconds_per_attention_pair) * sequences

    def swap_time(self, tokens: int) -> float:
        """Tswap: time to move `tokens` of KV cache one way over the host link."""
        return max(tokens, 0) / self.swap_tokens_per_s

    @property
    def full_iteration_s(self) -> float:
        """An iteration of a full budget as one first chunk (its context reads and attention pairs
        are those of the chunk alone)."""
        budget = self.token_budget
        return self.iteration_time(budget, budget, 1, attention_pairs(budget, 0))
