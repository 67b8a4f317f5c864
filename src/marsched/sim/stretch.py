"""Identical decode iterations run in one go: their time is an arithmetic series, summed exactly.

Each decode iteration after the first reads one more context token per sequence, so a stretch
of `n` iterations whose first takes `first` seconds and each next `growth` longer lasts
`n·first + growth·n(n−1)/2` (`series`); `iterations_to_reach` inverts it for the next event.
"""

from __future__ import annotations

import math

from marsched.sim.memory import blocks_for


def series(first: float, growth: float, iterations: int) -> float:
    """The time of `iterations` iterations, the first taking `first` and each next `growth` longer."""
    return iterations * first + growth * iterations * (iterations - 1) / 2


def iterations_to_reach(seconds: float, first: float, growth: float) -> int:
    """The fewest iterations (at least 1) whose series reaches `seconds`: the last one starts before it.

    An event `seconds` ahead is due at the start of the iteration after that, as when stepping one
    at a time. The tolerance, a billionth of an iteration, keeps an event that falls exactly on an
    iteration boundary on that boundary despite rounding.
    """
    target = seconds - 1e-9 * first
    if growth == 0.0:
        return max(math.ceil(target / first), 1)
    # Solve growth/2·n² + (first − growth/2)·n = target for n, then settle the integer by checking.
    half = first - growth / 2
    n = max(math.ceil((-half + math.sqrt(half * half + 2 * growth * max(target, 0.0))) / growth), 1)
    while n > 1 and series(first, growth, n - 1) >= target:
        n -= 1
    while series(first, growth, n) < target:
        n += 1
    return n


def steps_in_blocks(sequences: list[tuple[int, int]], limit: int, free_blocks: int, block_tokens: int) -> int:
    """The most decode steps, from 1 to `limit`, whose growth fits in `free_blocks`: each sequence
    (computed tokens, blocks held) computes one more token per step."""
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        extra = sum(max(blocks_for(computed + mid, block_tokens) - held, 0) for computed, held in sequences)
        if extra <= free_blocks:
            low = mid
        else:
            high = mid - 1
    return low
