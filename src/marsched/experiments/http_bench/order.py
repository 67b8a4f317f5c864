"""Which run comes when: repeats interleaved, so that a slow stretch of the machine hits every
configuration alike instead of all the repeats of one.

Repeat 1 runs every configuration, then repeat 2 runs every configuration, and so on; each repeat
starts one configuration further along the list (a rotation), so that no configuration is always
the first after a fresh start or always the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slot:
    repeat: int  # from 1
    config: str

    @property
    def label(self) -> str:
        return f"{self.config}-r{self.repeat}"


def run_order(configs: Sequence[str], repeats: int) -> list[Slot]:
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: give a number >= 1")
    n = len(configs)
    return [Slot(repeat, configs[(repeat - 1 + i) % n]) for repeat in range(1, repeats + 1) for i in range(n)]
