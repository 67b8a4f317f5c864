"""Simulated only, at run11-more's served step terms: which tasks make the p99 at run11's queueing load
(4 tasks/s), MARS, INFERCEPT and the host tier. Run from the repository root with the twin's model at
/tmp/twin/model (README). Prints each one's six longest tasks (id, e2e, alone, longest queue stay, calls),
then MARS's six longest beside the host tier's times."""
import json
from dataclasses import replace
from marsched.experiments.twin.__main__ import parse, plan_of
from marsched.experiments.twin.stream import replayed_requests
from marsched.experiments.twin.simulate import engine_profile
from marsched.experiments.twin.configs import twin_policy
from marsched.experiments.twin.served_costs import with_served_terms
from marsched.sim.select import make_simulator

if __name__ == "__main__":
    plan = plan_of(parse(["--model", "/tmp/twin/model", "--profile", "results/twin/run11/profile.json", "--out", "/tmp/diag/st", "--sim-only"]))
    load = replace(plan.load, rate=4.0)
    reqs = replayed_requests(load)
    served = json.load(open("results/twin/run11-more/records.json"))["served_costs"]["queueing"]
    out = {}
    for config in ("vllm-stock-host", "mars", "infercept"):
        profile = engine_profile(plan.sim_engine)
        profile = replace(profile, cost=with_served_terms(profile.cost, served[config]))
        policy = twin_policy(config, profile.cost, plan.pin_s, load.seed)
        recs = make_simulator(reqs, profile, policy, queued_turns=True).run().records
        out[config] = {r.request_id: r for r in recs}
        top = sorted(recs, key=lambda r: -r.e2e_s)[:6]
        print(config, [(r.request_id[-12:], round(r.e2e_s, 1), round(r.isolated_e2e_s, 1), round(r.max_wait_s, 1), len(r.strategies)) for r in top])
    for rid in sorted(out["mars"], key=lambda k: -out["mars"][k].e2e_s)[:6]:
        m, h = out["mars"][rid], out["vllm-stock-host"][rid]
        print(rid[-12:], "arrival", round(m.arrival_s, 1), "mars e2e", round(m.e2e_s, 1), "wait", round(m.max_wait_s, 1), "| host e2e", round(h.e2e_s, 1), "wait", round(h.max_wait_s, 1))
