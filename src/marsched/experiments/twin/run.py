"""The twin as it runs: per load, every configuration simulated, then run live (`http_bench`: each
configuration's server on the same model, KV size, engine options and cores, repeats interleaved),
then one record per configuration, load and repeat, and the side-by-side table.

Files under `out`: `<load>/` holds the live comparison of that load (`http_bench`'s files: its
`runs/<config>-r<k>/` and summary); `records.json` (`records.SCHEMA`) and `table.md` sit at the top,
rewritten after each load.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from marsched.atomic import write_atomically
from marsched.experiments.http_bench.configs import Engine
from marsched.experiments.http_bench.records import RunRecord
from marsched.experiments.http_bench.run import RESUME_MISMATCH_EXIT, Plan, check_resumable, run_plan
from marsched.experiments.twin.loads import pick_loads, relative_slowdowns, sweep
from marsched.experiments.twin.records import SCHEMA, Load, TwinRecord, live_numbers, markdown
from marsched.experiments.twin.served_costs import costs_by_config, step_time_ratio, with_served_terms
from marsched.experiments.twin.simulate import SimEngine, engine_profile, simulate
from marsched.experiments.twin.stream import replayed_requests
from marsched.loadgen.options import LoadgenOptions
from marsched.workload.model import Request

PROMPT_TOLERANCE = 0.05  # live prompt tokens against the simulated contexts
STEP_TOLERANCE = 0.15  # the servers' step time against the profile's
USAGE_EXIT = 2  # as a bad flag: the grid has no load of a kind the twin needs


def progress(message: str) -> None:
    print(f"twin: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class TwinPlan:
    configs: tuple[str, ...]
    loads: tuple[Load, ...] | None  # None: picked by the simulator over `grid`
    grid: tuple[float, ...]
    repeats: int
    engine: Engine  # the live servers'
    sim_engine: SimEngine
    load: LoadgenOptions  # the workload and its shaping; its rate is each load's
    pin_s: float  # continuum's T
    out: Path
    sim_only: bool = False
    start_timeout_s: float = 900.0
    resume: bool = False  # keep the live runs measured earlier in `out` (`http_bench.run.earlier_run`)

    def settings(self) -> dict[str, Any]:
        return {"configs": list(self.configs), "repeats": self.repeats, "grid": list(self.grid),
                "engine": {"model": self.engine.model, "kv_blocks": self.engine.kv_blocks,
                           "max_model_len": self.engine.max_model_len, "vllm_args": list(self.engine.extra),
                           "marsched_args": list(self.engine.marsched_extra)},
                "profile": self.sim_engine.profile, "workload": self.load.settings(), "continuum_pin_s": self.pin_s,
                "sim_only": self.sim_only}


class Simulations:
    """Each rate's replay, built once, and each configuration's simulation of it, run once: the load
    sweep and the chosen loads' comparison share them (the simulator is deterministic)."""

    def __init__(self, plan: TwinPlan) -> None:
        self.plan = plan
        self._replays: dict[float, list[Request]] = {}
        self._summaries: dict[tuple[str, float], dict[str, Any]] = {}

    def workload(self, rate: float) -> LoadgenOptions:
        return replace(self.plan.load, rate=rate)

    def replay(self, rate: float) -> list[Request]:
        if rate not in self._replays:
            self._replays[rate] = replayed_requests(self.workload(rate))
        return self._replays[rate]

    def summary(self, config: str, rate: float) -> dict[str, Any]:
        key = (config, rate)
        if key not in self._summaries:
            plan = self.plan
            self._summaries[key] = simulate(config, self.workload(rate), plan.sim_engine, plan.pin_s, self.replay(rate))
        return self._summaries[key]

    def served_summary(self, config: str, rate: float, served: dict[str, Any]) -> dict[str, Any]:
        """`summary` with the step costs the live servers learned (`served_costs`), not cached."""
        plan = self.plan
        return simulate(config, self.workload(rate), plan.sim_engine, plan.pin_s, self.replay(rate), served)


def choose_loads(plan: TwinPlan, simulations: Simulations) -> tuple[Load, ...]:
    if plan.loads is not None:
        return plan.loads
    points = sweep(plan.configs, plan.grid, simulations.summary)
    for rate, slowdowns in relative_slowdowns(points).items():
        progress(f"sweep at {rate:g} tasks/s, slowdown over unloaded: "
                 + ", ".join(f"{config} {value:.2f}x" for config, value in slowdowns.items()))
    loads = pick_loads(points)
    progress("loads: " + ", ".join(f"{load.name} {load.rate:g} tasks/s" for load in loads))
    return loads


def load_runs(plan: TwinPlan, sims: dict[str, dict[str, Any]], folder: Path) -> list[RunRecord]:
    """The live runs of one load's comparison in `folder`, read back from their run files."""
    runs = []
    for run_file in sorted(folder.glob("runs/*/run.json")):
        run = RunRecord.from_dict(json.loads(run_file.read_text()))
        if run.config in sims and run.repeat <= plan.repeats:  # else an earlier comparison's run in the same folder
            runs.append(run)
    return runs


def servers_step_costs(plan: TwinPlan, load: Load, runs: list[RunRecord]) -> dict[str, dict[str, Any]] | None:
    """Per configuration, the step costs the marsched servers of this load's `runs` (`load_runs`) learned
    (`served_costs.costs_by_config`), each with its step time over the profile's; None when none learned
    them (stock vLLM only, or runs from before they were kept)."""
    costs = costs_by_config(((run.config, run.cost_model) for run in runs if run.measured), plan.configs)
    if costs is None:
        return None
    profile_cost = engine_profile(plan.sim_engine).cost
    for terms in costs.values():
        terms["step_time_ratio"] = step_time_ratio(profile_cost, with_served_terms(profile_cost, terms))
    ratios = [terms["step_time_ratio"] for terms in costs.values()]
    progress(f"[{load.name}] the servers' steps took {min(ratios):.2f}-{max(ratios):.2f}x the profile's "
             "(each configuration's learned terms); simulating again with them")
    if any(abs(ratio - 1) > STEP_TOLERANCE for ratio in ratios):
        progress(f"[{load.name}] WARNING: the profile's steps are not the servers': it was measured on another machine, "
                 "or of the engine alone (docs/twin.md, \"The servers' step costs\")")
    return costs


def live_records(plan: TwinPlan, load: Load, sims: dict[str, dict[str, Any]], runs: list[RunRecord],
                 requests: list[Request], served_sims: dict[str, dict[str, Any]] | None = None) -> list[TwinRecord]:
    """The records of one load's live comparison, from its runs (`load_runs`); `requests`: the load's
    replay, as simulated; `served_sims`: each configuration's simulation at the servers' step costs."""
    contexts = {r.request_id: [s.context_tokens for s in r.segments] for r in requests}
    records = []
    for run in runs:
        live = None
        if run.measured:
            live = live_numbers(json.loads(Path(run.loadgen).read_text()), contexts)
            ratio = live["prompt_tokens_ratio"]
            if ratio is not None and abs(ratio - 1) > PROMPT_TOLERANCE:
                progress(f"[{load.name}] WARNING: {run.config}'s server counted {ratio:.2f}x the simulated "
                         "prompt tokens: the filler is not a token a word on this model (docs/twin.md)")
        records.append(TwinRecord(run.config, load, run.repeat, sims[run.config], live,
                                  None if run.measured else (run.error or "interrupted"),
                                  None if served_sims is None else served_sims[run.config]))
    return sorted(records, key=lambda r: (plan.configs.index(r.config), r.repeat))


def write_results(plan: TwinPlan, records: list[TwinRecord],
                  served: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """records.json and table.md; `served`: per load and configuration, the servers' step costs (`servers_step_costs`)."""
    text = markdown(records, served or {})
    plan.out.mkdir(parents=True, exist_ok=True)
    payload = {"schema": SCHEMA, "settings": plan.settings(), "records": [r.to_dict() for r in records],
               "served_costs": served or {}}
    write_atomically(plan.out / "records.json",
                     lambda f: f.write((json.dumps(payload, indent=1, allow_nan=False) + "\n").encode()))
    write_atomically(plan.out / "table.md", lambda f: f.write(text.encode()))
    return text


def live_plan(plan: TwinPlan, load: Load, workload: LoadgenOptions) -> Plan:
    """The live comparison of one load: every configuration's server on its workload, in `out/<load>`."""
    return Plan(plan.configs, plan.repeats, plan.engine, workload, plan.pin_s, plan.out / load.name,
                plan.start_timeout_s, plan.resume)


def run_twin(plan: TwinPlan) -> int:
    """Simulate, then run live, load by load; the exit status of the live runs (0: all measured)."""
    status = 0
    records: list[TwinRecord] = []
    served: dict[str, dict[str, dict[str, Any]]] = {}  # load -> configuration -> the step costs its servers learned
    simulations = Simulations(plan)
    if plan.resume and not plan.sim_only and plan.loads is not None:
        try:  # before minutes of simulation: runs of other settings stop it as they would later
            for load in plan.loads:
                check_resumable(live_plan(plan, load, simulations.workload(load.rate)))
        except ValueError as error:
            progress(f"STOPPED: {error}")
            return RESUME_MISMATCH_EXIT
    try:
        loads = choose_loads(plan, simulations)
    except ValueError as error:  # no rate of the grid is light, or none queues: the user widens --grid
        print(f"error: {error}", file=sys.stderr)
        return USAGE_EXIT
    for load in loads:
        workload, requests = simulations.workload(load.rate), simulations.replay(load.rate)
        sims = {}
        for config in plan.configs:
            sims[config] = simulations.summary(config, load.rate)
            progress(f"[{load.name}] simulated {config}: mean {sims[config]['e2e_mean_s']:.2f} s, "
                     f"p99 {sims[config]['e2e_p99_s']:.2f} s over {sims[config]['num_finished']} tasks")
        if plan.sim_only:
            records += [TwinRecord(config, load, 0, sims[config], None) for config in plan.configs]
        else:
            live = live_plan(plan, load, workload)
            status = max(status, run_plan(live))
            runs = load_runs(plan, sims, live.out)
            costs = servers_step_costs(plan, load, runs)
            served_sims = None
            if costs is not None:
                served[load.name] = costs
                served_sims = {config: simulations.served_summary(config, load.rate, costs[config])
                               for config in plan.configs}
            records += live_records(plan, load, sims, runs, requests, served_sims)
        write_results(plan, records, served)
        if status not in (0, 1):  # interrupted, the servers' cores differ, or --resume found other settings: stop here
            break
    print(write_results(plan, records, served), end="", flush=True)
    progress(f"records: {plan.out / 'records.json'}, table: {plan.out / 'table.md'}")
    return status
