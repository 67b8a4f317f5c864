"""Outputs of a comparison: the JSON list of records and a plot."""

from __future__ import annotations

import json
import os

from marsched.atomic import write_atomically


def write_json(records: list[dict], path: str | os.PathLike[str]) -> None:
    write_atomically(path, lambda f: f.write((json.dumps(records, indent=2) + "\n").encode()))


def plot_latency(records: list[dict], path: str | os.PathLike[str]) -> None:
    """Mean and p99 end-to-end latency against QPS, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(dict.fromkeys(r["policy"] for r in records))
    for policy in policies:
        points = sorted((r["qps"], r["e2e_mean_s"], r["e2e_p99_s"]) for r in records if r["policy"] == policy)
        qps = [p[0] for p in points]
        axes[0].plot(qps, [p[1] for p in points], marker="o", label=policy)
        axes[1].plot(qps, [p[2] for p in points], marker="o", label=policy)
    first = records[0]
    for axis, title in zip(axes, ("mean end-to-end latency", "p99 end-to-end latency")):
        axis.set_xlabel("requests per second")
        axis.set_ylabel("seconds")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{first['profile']} · {first['trace']} · {first['duration_s']:g} s · seed {first['seed']} · {first['predictor']}")
    figure.tight_layout()
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)
