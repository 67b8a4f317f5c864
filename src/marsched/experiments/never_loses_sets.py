"""The run sets of scripts/never_loses.sh, in one place: profile, results folder, loads, most
loaded point of each trace, the seeds of the sweep there and the frontier's variants.
`never_loses_tables` reads them; never_loses.sh reads them as shell assignments
(`scripts/never_loses_sets.py SET` prints `shell(SET)`)."""

from __future__ import annotations

from dataclasses import dataclass

TRACES = ("single", "multi", "agent")
SEEDS = (0, 1, 2, 3, 4)  # the sweep at the most loaded points (`never_loses.sh SET --seeds`)
# The trade-off frontier at the most loaded points: `fcfs-wait` multiples and `age` thresholds (s)
# run besides the variants' own (multiple 2, 15 s), which the runs over all loads already cover.
FRONTIER_MULTIPLES = (0.8, 1, 1.25, 1.5, 3, 4)
FRONTIER_AGES_S = (60, 240)


@dataclass(frozen=True)
class RunSet:
    profile: str  # --profile
    label: str  # the profile's name in tables and plots
    folder: str  # under results/
    loads: dict[str, tuple[float, ...]]  # qps per trace, light load to past saturation
    top: dict[str, float]  # the most loaded point of each trace


# Each range runs from light load to 2.5-3 times the load where INFERCEPT starts to queue
# (GPT-J: about 6, 2 and 0.15 qps; the calibrated engine: about 9, 5 and 0.8 qps).
RUN_SETS = {
    "gptj": RunSet("gptj-6b-a100", "gptj-6b-a100", "never-loses",
                   {"single": (3, 4, 5, 6, 8, 10, 12, 14, 16), "multi": (0.5, 1, 1.5, 2, 2.5, 3, 4, 5),
                    "agent": (0.05, 0.1, 0.15, 0.2, 0.3, 0.4)},
                   {"single": 16, "multi": 5, "agent": 0.4}),
    "calibrated": RunSet("results/calibrated-cpu.json", "calibrated-cpu", "never-loses-calibrated",
                         {"single": (4, 6, 8, 9, 10, 12, 16, 20, 24), "multi": (2, 3, 4, 5, 6, 8, 10, 12, 14),
                          "agent": (0.2, 0.4, 0.6, 0.8, 1, 1.25, 1.5, 2)},
                         {"single": 24, "multi": 14, "agent": 2}),
}


def shell(name: str) -> str:
    """Bash assignments for never_loses.sh: profile, out, loads[trace], top[trace], seeds, and the
    frontier's multiples and ages."""
    s = RUN_SETS[name]
    loads = " ".join(f"[{t}]={','.join(f'{q:g}' for q in s.loads[t])}" for t in TRACES)
    top = " ".join(f"[{t}]={s.top[t]:g}" for t in TRACES)
    return (f"profile={s.profile}; out=results/{s.folder}\n"
            f"declare -A loads=({loads})\ndeclare -A top=({top})\nseeds=({' '.join(map(str, SEEDS))})\n"
            f"multiples=({' '.join(f'{m:g}' for m in FRONTIER_MULTIPLES)})\nages=({' '.join(f'{a:g}' for a in FRONTIER_AGES_S)})\n")
