"""Where two configurations' light-load time goes, turn by turn: each turn's time to its first token
(TTFT) and the rest of it (decode), each turn's median over the repeats, summed over the tasks'
turns, first turns apart from follow-ups. Usage, from the repository root:

    .venv/bin/python results/twin/run13-light-vllm/turns.py results/twin/run13-light-vllm/light/runs vllm-stock vllm
"""
import json
import statistics
import sys
from pathlib import Path


def turn_times(runs: Path, config: str) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(conversation, turn index) -> each repeat's (TTFT, decode) in seconds."""
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for run in sorted(runs.glob(f"{config}-r*")):
        for record in json.loads((run / "loadgen.json").read_text())["records"]:
            for turn in record["turns"]:
                times.setdefault((record["conversation"], turn["index"]), []).append(
                    (turn["ttft_s"], turn["latency_s"] - turn["ttft_s"]))
    return times


if __name__ == "__main__":
    runs, configs = Path(sys.argv[1]), sys.argv[2:]
    sums = {}
    for config in configs:
        times = turn_times(runs, config)
        row = {}
        for part, index in (("TTFT", 0), ("decode", 1)):
            for kind, first in (("first turns", True), ("follow-ups", False)):
                row[f"{kind}' {part}"] = sum(statistics.median(t[index] for t in reps)
                                             for (_, i), reps in times.items() if (i == 0) == first)
        sums[config] = row
        print(config, "turns", len(times), "repeats", sorted({len(r) for r in times.values()}))
    print("| | " + " | ".join(configs) + " |\n" + "| --- " * (len(configs) + 1) + "|")
    for name in sums[configs[0]]:
        print(f"| {name} | " + " | ".join(f"{sums[c][name]:.2f}" for c in configs) + " |")
