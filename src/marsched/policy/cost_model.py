"""The engine's costs as the policies see them: iteration time, recompute time, swap time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Iteration time `c + a·tokens` under a per-iteration token budget, and a host link.

    Units: seconds and tokens of KV cache.
    """

    seconds_per_token: float  # a
    seconds_per_iteration: float  # c
    token_budget: int
    swap_tokens_per_s: float

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token budget must be >= 1, got {self.token_budget}")
        if self.swap_tokens_per_s <= 0:
            raise ValueError(f"swap bandwidth must be > 0 tokens/s, got {self.swap_tokens_per_s}")

    def iteration_time(self, tokens: int) -> float:
        return self.seconds_per_iteration + self.seconds_per_token * tokens

    def recompute_time(self, tokens: int) -> float:
        """Tfwd: time to prefill `tokens` in budget-sized chunks, one chunk per iteration."""
        full_chunks, rest = divmod(max(tokens, 0), self.token_budget)
        time = full_chunks * self.iteration_time(self.token_budget)
        return time + (self.iteration_time(rest) if rest else 0.0)

    def swap_time(self, tokens: int) -> float:
        """Tswap: time to move `tokens` of KV cache one way over the host link."""
        return max(tokens, 0) / self.swap_tokens_per_s

    @property
    def full_iteration_s(self) -> float:
        return self.iteration_time(self.token_budget)
