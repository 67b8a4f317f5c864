"""INFERCEPT as its published code schedules (`infercept-code`), the formulas; the engine is
`sim/infercept_code.py`.

The INFERCEPT paper (ICML 2024) prices each strategy once at the call; the code its
evaluation ran (WukLab/InferCept@3a1a4da, `vllm/core/scheduler_v2.py`) does something
else, and that is what its published curves measure:

- every call starts preserved;
- every iteration each preserved call is priced again: Preserve as the device memory
  held for the rest of the call, Discard as recomputing it in the chunks the running
  batch leaves of the token budget (`chunked_discard_waste`). Calls that are cheaper
  to discard are discarded, except the most expensive of them, which becomes the
  target that the next memory shortfall swaps out (`discard_and_targets`);
- swapping moves blocks from the tail of a victim, at most `SwapBudgets` blocks each
  way per iteration, the budgets shrinking or growing with free memory (`swap_budgets`).

Under load the running batch fills the budget, the recompute chunk falls to one token,
and nothing is discarded any more: the code turns into Preserve with a trickle of swaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marsched.policy.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class SwapBudgetFit:
    """The constants of `swap_budgets`: INFERCEPT's fit of its swap time ("t_sin", "t_offset").

    The defaults are GPT-J 6B's on one A100 (WukLab/InferCept@3a1a4da exps/6B_bench.sh, which
    writes them into `_set_max_ragged_batch`); the 13B fit is α = −0.3297, offset 93.99.
    """

    alpha: float = 0.00462
    offset_tokens: float = 108.99


GPTJ_6B_SWAP_FIT = SwapBudgetFit()


@dataclass(frozen=True, slots=True)
class SwapBudgets:
    """Blocks that may move host→device (`in_blocks`) and device→host (`out_blocks`) this iteration."""

    in_blocks: int
    out_blocks: int


def swap_budgets(free_tokens: int, token_budget: int, block_tokens: int,
                 fit: SwapBudgetFit = GPTJ_6B_SWAP_FIT) -> SwapBudgets:
    """`_set_max_ragged_batch`: with F free device tokens and budget M,
    in = (α·M + offset + F/2) // B and out = ((1+α)·M + offset − F/2) // B, neither below 0.

    Swapping out is allowed only while memory is nearly full (with GPT-J's fit, 7 blocks at
    F = 0 and none above about 860 free tokens); swapping in grows with free memory.
    """
    t_in = fit.alpha * token_budget + fit.offset_tokens + free_tokens / 2
    t_out = (1 + fit.alpha) * token_budget + fit.offset_tokens - free_tokens / 2
    return SwapBudgets(max(0, math.floor(t_in / block_tokens)), max(0, math.floor(t_out / block_tokens)))


def recompute_chunk_tokens(token_budget: int, running_pending_tokens: int) -> int:
    """c_h: the tokens per iteration a recompute would get, what the running batch's own pending
    tokens leave of the budget; at least one."""
    return max(token_budget - running_pending_tokens, 1)


def chunked_discard_waste(held_tokens: int, chunk_tokens: int, running_kv_tokens: int, cost: CostModel) -> float:
    """`discard_waste`, in token·seconds: recomputing `held_tokens` in chunks of c_h.

    With n = ⌈L/c_h⌉ − 1 full chunks and a rest r = L mod c_h, and R the running batch's KV:
    the chunks rebuilt so far are held for an iteration each, f_s·c_h·n(n+1)/2 with f_s a full
    iteration's time; each chunk makes every running sequence's iteration a·c_h longer,
    a·c_h·n·R; the rest does the same for itself and the batch, a·r·(R + r). The cost model's
    a and c stand for INFERCEPT's constants of the same name.
    """
    n = max(-(-held_tokens // chunk_tokens) - 1, 0)
    rest = held_tokens % chunk_tokens
    full_iteration_s = cost.seconds_per_iteration + cost.seconds_per_token * cost.token_budget
    waste = full_iteration_s * chunk_tokens * n * (n + 1) / 2
    waste += cost.seconds_per_token * chunk_tokens * n * running_kv_tokens
    waste += cost.seconds_per_token * rest * (running_kv_tokens + rest)
    return waste


@dataclass(frozen=True, slots=True)
class PausedWaste:
    """One preserved call's wastes this iteration: Preserve (device tokens × remaining call time,
    negative once the call overruns) and chunked Discard."""

    request_id: str
    preserve: float
    discard: float


def discard_and_targets(wastes: list[PausedWaste]) -> tuple[list[str], list[str]]:
    """(discard now, swap-out targets): of the calls cheaper to discard than to keep, all but the
    most expensive are discarded; the most expensive (every one tied with it) stays preserved as
    a target of the next shortfall. A lone candidate is therefore never discarded, only swapped."""
    candidates = [w for w in wastes if w.discard < w.preserve]
    if not candidates:
        return [], []
    highest = max(w.discard for w in candidates)
    discard = [w.request_id for w in candidates if w.discard < highest]
    targets = [w.request_id for w in candidates if w.discard >= highest]
    return discard, targets
