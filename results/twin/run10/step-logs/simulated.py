"""The logged runs simulated at three fits of their own steps: the fit decided with (forgetting,
steps weighed alike), and the whole run's, weighed alike and by time (docs/twin.md, "The servers'
step costs"). Prints each one's mean per task beside the live mean from its loadgen log. Run from
the repository root with the twin's model at /tmp/twin/model (README); about a minute."""
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from marsched.experiments.twin.__main__ import parse, plan_of
from marsched.experiments.twin.configs import twin_policy
from marsched.experiments.twin.simulate import engine_profile
from marsched.experiments.twin.step_log import fitted_terms, read_steps
from marsched.experiments.twin.stream import replayed_requests
from marsched.policy.learned_cost import LearnSettings, StepTimeFit, StepWeight, terms_of, with_terms
from marsched.sim.select import make_simulator

LOGS = Path(__file__).parent
RUNS = {"host": "vllm-stock-host", "stock": "vllm-stock"}  # log -> the configuration it ran

if __name__ == "__main__":
    plan = plan_of(parse(["--model", "/tmp/twin/model", "--profile", "results/twin/run9/profile.json",
                          "--out", "/tmp/step-logs-simulated", "--sim-only"]))
    requests = replayed_requests(replace(plan.load, rate=10.0))  # live.sh's load
    for name, config in RUNS.items():
        steps = read_steps(LOGS / f"{name}.steps.jsonl")
        latest = fitted_terms(steps, plan.sim_engine.max_num_batched_tokens)["latest"]
        alike = StepTimeFit(terms_of(latest), LearnSettings(memory_steps=math.inf))
        by_time = StepTimeFit(terms_of(latest), LearnSettings(memory_steps=math.inf), StepWeight.TIME)
        for fit in (alike, by_time):
            for step in steps:
                fit.record(step.shape, step.seconds)
        live = re.search(r"conversations: .*?latency mean/p50/p99 ([\d.]+)", (LOGS / f"{name}.loadgen.log").read_text())
        print(f"{name} ({config}): live mean {float(live.group(1)):.2f} s")
        for label, cost in (("latest, weighed alike", latest), ("whole run, weighed alike", with_terms(latest, alike.fit())),
                            ("whole run, weighed by time", with_terms(latest, by_time.fit()))):
            profile = replace(engine_profile(plan.sim_engine), cost=cost)
            records = make_simulator(requests, profile, twin_policy(config, cost, plan.pin_s, 0), queued_turns=True).run().records
            print(f"  simulated at the {label} fit: mean {np.mean([r.e2e_s for r in records]):.2f} s")
