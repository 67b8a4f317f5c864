"""Simulated only: MARS against the host tier and INFERCEPT at the twin's queueing loads over eight
workload seeds, on two machines' served step terms (the third's at 10 tasks/s, run10; the fourth's
at 4 tasks/s, run11-more), MARS with `fcfs-wait` multiples 1, 1.5, 2 (its default) and 3, and MARS's
tail-bounded orders `mars-boost` and `mars-nudge` (docs/policies.md), which serve `marsched serve
--policy` too and are priced here at MARS's server's terms. Per seed:
each one's mean and p99 per task, MARS's over the better of the other two; then, per machine, the
p99 of all seeds' tasks pooled, on how many seeds each one's p99 is above the better other's and its
mean above 0.85x it, and each one's mean slowdown (e2e over alone) of the largest 3% of
tasks (by time alone). Run from the repository root with the twin's model at /tmp/twin/model (README);
about 6 minutes. Its output as run: simseeds.txt."""
import json
from dataclasses import replace

import numpy as np

from marsched.experiments.twin.__main__ import parse, plan_of
from marsched.experiments.twin.configs import twin_policy
from marsched.experiments.twin.served_costs import with_served_terms
from marsched.experiments.twin.simulate import engine_profile
from marsched.experiments.twin.stream import replayed_requests
from marsched.predict import SegmentPredictor, parse_api_estimator, parse_length_predictor
from marsched.predict.online import DEFAULT_API_ESTIMATOR, DEFAULT_PREDICTOR
from marsched.policy.registry import make_policy, starvation_config
from marsched.sim.select import make_simulator

MACHINES = {"third (run10, 10 tasks/s)": ("results/twin/run9/profile.json", "results/twin/run10/records.json", 10.0),
            "fourth (run11-more, 4 tasks/s)": ("results/twin/run11/profile.json", "results/twin/run11-more/records.json", 4.0)}
OTHERS = ("vllm-stock-host", "infercept")
MARS = ("fcfs-wait:1", "fcfs-wait:1.5", "fcfs-wait", "fcfs-wait:3")
ORDERS = ("mars-boost", "mars-nudge")  # with their own defaults, as `twin_policy` builds MARS
SEEDS = range(8)


def tasks(plan, served, seed, rate, config, starvation=None, order=None):
    profile = engine_profile(plan.sim_engine)
    profile = replace(profile, cost=with_served_terms(profile.cost, served[config]))
    policy = twin_policy(config, profile.cost, plan.pin_s, seed)
    if order:
        predictor = SegmentPredictor(parse_length_predictor(DEFAULT_PREDICTOR, seed), parse_api_estimator(DEFAULT_API_ESTIMATOR))
        policy = make_policy(order, profile.cost, predictor, prefix_cache=True, rest="gittins")
    if starvation:
        policy = replace(policy, starvation=starvation_config(starvation))
    reqs = replayed_requests(replace(plan.load, rate=rate, seed=seed))
    return [(r.e2e_s, r.isolated_e2e_s) for r in make_simulator(reqs, profile, policy, queued_turns=True).run().records]


if __name__ == "__main__":
    for machine, (profile_path, records_path, rate) in MACHINES.items():
        plan = plan_of(parse(["--model", "/tmp/twin/model", "--profile", profile_path, "--out", "/tmp/simseeds", "--sim-only"]))
        served = json.load(open(records_path))["served_costs"]["queueing"]
        names = (*OTHERS, *(f"mars {v}" for v in MARS), *ORDERS)
        pooled = {name: [] for name in names}
        above = dict.fromkeys(names, 0)  # seeds whose p99 is above the better other's
        slow = dict.fromkeys(names, 0)  # seeds whose mean is above 0.85x the better other's (the goal)
        print(f"## {machine}\n\n| seed | tasks | " + " | ".join(f"{n} mean / p99" for n in names)
              + " | MARS's (default) mean / p99 over the better other's |\n" + "| --- " * (len(names) + 3) + "|")
        for seed in SEEDS:
            run = {name: tasks(plan, served, seed, rate, name) for name in OTHERS}
            run |= {f"mars {v}": tasks(plan, served, seed, rate, "mars", v) for v in MARS}
            run |= {order: tasks(plan, served, seed, rate, "mars", order=order) for order in ORDERS}
            stats = {n: (np.mean([e for e, _ in t]), np.percentile([e for e, _ in t], 99)) for n, t in run.items()}
            best_mean, best_p99 = (min(stats[n][i] for n in OTHERS) for i in (0, 1))
            m = stats["mars fcfs-wait"]
            print(f"| {seed} | {len(run['infercept'])} | " + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in stats.values())
                  + f" | {m[0] / best_mean:.2f} / {m[1] / best_p99:.2f} |", flush=True)
            for n, t in run.items():
                pooled[n] += t
                above[n] += stats[n][1] > best_p99
                slow[n] += stats[n][0] > 0.85 * best_mean
        print("\n| all seeds pooled | " + " | ".join(names) + " |\n" + "| --- " * (len(names) + 1) + "|")
        print("| p99 s | " + " | ".join(f"{np.percentile([e for e, _ in t], 99):.1f}" for t in pooled.values()) + " |")
        largest = {n: sorted(t, key=lambda x: x[1])[-max(len(t) * 3 // 100, 1):] for n, t in pooled.items()}
        print(f"| seeds of {len(SEEDS)} with p99 above the better other's | " + " | ".join(str(above[n]) for n in names) + " |")
        print(f"| seeds of {len(SEEDS)} with mean above 0.85x the better other's | " + " | ".join(str(slow[n]) for n in names) + " |")
        print("| slowdown of the largest 3% | " + " | ".join(f"{np.mean([e / i for e, i in t]):.2f}" for t in largest.values())
              + " |\n", flush=True)
