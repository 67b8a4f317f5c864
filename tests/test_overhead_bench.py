"""The scheduler-overhead benchmark (`marsched.bench.overhead`): its pure parts without vLLM, and one
tiny end-to-end run on real vLLM with the Swap connector (marked `vllm`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from marsched.bench.overhead import (
    STATS, OverheadPlan, child_command, format_table, goal, main, overheads, parser, plan_from_args, quantile,
    report, snapshot_steps, step_stats, summarize,
)

def plan_of(*argv: str) -> OverheadPlan:
    return plan_from_args(parser().parse_args(list(argv)))


# --- quantiles and per-run statistics ---------------------------------------------------------------


def test_quantile_interpolates_like_numpy():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 100, 301):
        values = list(rng.exponential(size=n))
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5  # order does not matter; halfway between 2 and 3
    assert quantile(list(range(101)), 0.99) == pytest.approx(99.0)
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match="from 0 to 1"):
        quantile([1.0], 1.5)


def test_step_stats_takes_quantiles_of_the_per_step_sum():
    # The slow schedule() and the slow update are in different steps: two slow sums of 100, so the
    # p99 of the sum is near 10 ms, while each part's p99 (one slow value of 100) is near 1 ms.
    rows = [{"sched_s": 0.001, "update_s": 0.0001, "step_s": 0.002} for _ in range(98)]
    rows.append({"sched_s": 0.010, "update_s": 0.0001, "step_s": 0.02})
    rows.append({"sched_s": 0.001, "update_s": 0.010, "step_s": 0.02})
    stats = step_stats(rows)
    assert set(stats) == {*STATS, "step_p50_ms"}
    assert stats["schedule_p50_ms"] == pytest.approx(1.0)
    assert stats["update_p50_ms"] == pytest.approx(0.1)
    assert stats["total_p50_ms"] == pytest.approx(1.1)
    totals = [r["sched_s"] + r["update_s"] for r in rows]
    assert stats["total_p99_ms"] == pytest.approx(float(np.quantile(totals, 0.99)) * 1e3)
    assert stats["total_p99_ms"] > stats["schedule_p99_ms"] + stats["update_p99_ms"] + 5.0
    assert stats["step_p50_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no measured steps"):
        step_stats([])


def test_snapshot_steps_finds_the_step_each_publication_happened_in():
    rows = [{"t": t} for t in (10.0, 10.5, 11.0, 11.5)]
    assert snapshot_steps(rows, [10.01, 11.2, 11.3, 12.0]) == [0, 2, 3]  # two in one step count once
    assert snapshot_steps(rows, [9.0]) == []  # before the measured steps
    assert snapshot_steps(rows, []) == []


# --- medians over repeats, differences, the goal, the table ----------------------------------------


def fake_run(scheduler: str, waiting: int, repeat: int, base: float, running: int = 8) -> dict:
    stats = {key: base + 0.01 * i for i, key in enumerate(STATS)}
    return {"scheduler": scheduler, "waiting": waiting, "repeat": repeat, "running": running,
            "snapshot_steps": 2, "step_p50_ms": 3.0, "load_average": [1.0 + repeat, 2.0], "vllm": "0.32.0", **stats}


def fake_runs(plan: OverheadPlan, mars_base: dict[int, list[float]], mars_running: int = 8) -> list[dict]:
    runs = []
    for r in range(plan.repeats):
        for waiting in plan.sizes:
            runs.append(fake_run("stock", waiting, r, 0.1 * (r + 1)))
            runs.append(fake_run("mars", waiting, r, mars_base[waiting][r], mars_running))
    return runs


def test_medians_over_repeats_and_the_differences():
    plan = OverheadPlan(sizes=(100, 10000), policies=("mars",), repeats=3)
    runs = fake_runs(plan, {100: [0.5, 0.3, 0.4], 10000: [5.0, 1.0, 0.9]})
    summary = summarize(runs, plan)
    assert [(s["waiting"], s["scheduler"]) for s in summary] == [(100, "stock"), (100, "mars"),
                                                                  (10000, "stock"), (10000, "mars")]
    mars = summary[3]
    assert mars["schedule_p50_ms"] == pytest.approx(1.0)  # median of 5.0, 1.0, 0.9
    assert mars["schedule_p50_ms_range"] == pytest.approx([0.9, 5.0])
    assert summary[2]["total_p99_ms"] == pytest.approx(0.2 + 0.05)  # stock: median base 0.2, 6th statistic
    added = overheads(runs, summary, plan)
    big = added[1]
    assert (big["waiting"], big["policy"], big["same_batch"]) == (10000, "mars", True)
    assert big["total_p99_ms"] == pytest.approx(1.0 - 0.2)  # difference of the medians
    assert big["total_p99_ms_per_repeat"] == pytest.approx([5.0 - 0.1, 1.0 - 0.2, 0.9 - 0.3])  # paired by repeat
    assert goal(added, "off") is None  # the goal is with the connector on
    assert goal(added, "on") == {"waiting": 10000, "policy": "mars", "statistic": "total_p99_ms",
                           "added_ms": pytest.approx(0.8), "limit_ms": 1.0, "met": True}
    worse = overheads(fake_runs(plan, {100: [0.5] * 3, 10000: [2.0] * 3}), summarize(
        fake_runs(plan, {100: [0.5] * 3, 10000: [2.0] * 3}), plan), plan)
    assert goal(worse, "on")["met"] is False
    assert goal(overheads(runs, summary, OverheadPlan(sizes=(100,), policies=("mars",), repeats=3)), "on") is None


def test_a_missing_run_is_named():
    plan = OverheadPlan(sizes=(100,), policies=("mars",), repeats=2)
    runs = fake_runs(plan, {100: [0.5, 0.6]})
    with pytest.raises(ValueError, match="no run of vllm with 100 waiting"):
        summarize(runs, OverheadPlan(sizes=(100,), policies=("mars", "vllm"), repeats=2))
    summary = summarize(runs[:-1], plan)  # mars's second repeat is gone: the pairing says so
    with pytest.raises(ValueError, match="no run of mars with 100 waiting in repeat 1"):
        overheads(runs[:-1], summary, plan)


def test_table_has_every_size_scheduler_and_difference():
    plan = OverheadPlan(sizes=(100, 10000), policies=("mars",), repeats=3, steps=50)
    runs = fake_runs(plan, {100: [0.5, 0.3, 0.4], 10000: [5.0, 3.0, 2.0]}, mars_running=7)
    document = report(plan, runs)
    table = format_table(document["summary"], document["overhead"], plan)
    lines = table.splitlines()
    assert "over 50 steps, median of 3 repeat(s); connector on" in lines[0]
    assert "schedule() p50" in lines[1] and "sum p99" in lines[1]
    rows = [line.split() for line in lines[2:-1]]
    assert [r[:2] for r in rows] == [["100", "stock"], ["100", "mars"], ["100", "mars-stock"],
                                     ["10000", "stock"], ["10000", "mars"], ["10000", "mars-stock"]]
    assert rows[5][2] == "+2.800"  # schedule p50: median 3.0 - median 0.2
    assert "batches differ" in lines[-2]  # 7 running against stock's 8
    assert lines[-1].startswith("goal: mars adds +2.800 ms at p99") and lines[-1].endswith("NOT met")
    assert document["machine"]["load_average"] == [1.0, 3.0]
    assert document["plan"]["blocks"] == plan.kv_blocks and document["plan"]["max_tokens"] == plan.tokens


# --- options --------------------------------------------------------------------------------------


def test_defaults_fit_the_batch_and_keep_it_steady():
    plan = plan_of()
    assert plan.sizes == (100, 1000, 10000) and plan.policies == ("mars", "vllm") and plan.connector == "on"
    assert plan.schedulers == ("stock", "mars", "vllm")
    assert plan.tokens == plan.warmup + plan.steps + 10  # nothing finishes while measured
    assert plan.kv_blocks == 8 * (-(-(48 + plan.tokens) // 32) + 1) + 1  # MARS's admission: a block more each
    assert plan_of("--blocks", "500").kv_blocks == 500
    assert plan_of("--connector", "off", "--policies", "mars").connector == "off"


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "100,0"], "--sizes: 0 waiting requests"),
    (["--sizes", "1e3"], "--sizes 1e3: give whole numbers"),
    (["--sizes", ","], "--sizes: give at least one"),
    (["--policies", "mars,stock"], "'stock' is always measured"),
    (["--policies", "mars,mars"], "named twice"),
    (["--policies", "fastest"], "--policies fastest: unknown policy"),
    (["--steps", "0"], "--steps 0"),
    (["--repeats", "0"], "--repeats 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0"),
    (["--warmup", "-1"], "--warmup -1"),
    (["--host-swap-tokens", "0"], "--host-swap-tokens 0"),
    (["--refresh-interval", "0"], "--refresh-interval 0"),
    (["--blocks", "104"], "--blocks 104: 8 requests of 368 tokens need 105 blocks"),
])
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(ValueError) as error:
        plan_of(*argv)
    assert message in str(error.value)
    assert main(argv) == 2  # the command says so and starts nothing
    assert message in capsys.readouterr().err


def test_child_command_carries_the_whole_plan():
    plan = OverheadPlan(sizes=(100, 1000), policies=("vllm",), connector="off", max_num_seqs=4, prompt=16,
                        refresh_interval=3, host_swap_tokens=4096, warmup=2, steps=7, repeats=3)
    command = child_command(plan, "/m", "vllm", 1000, None)
    assert command[1:4] == ["-m", "marsched.bench.overhead", "--one"] and command[4] == "vllm:1000"
    child = plan_from_args(parser().parse_args(command[3:]))
    for name in ("policies", "connector", "max_num_seqs", "prompt", "tokens", "kv_blocks", "refresh_interval",
                 "host_swap_tokens", "warmup", "steps"):
        assert getattr(child, name) == getattr(plan, name), name
    assert child_command(plan, "/m", "stock", 100, "/p/x.prof")[-2:] == ["--profile", "/p/x.prof"]


# --- end to end on vLLM ---------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_tiny_run_with_the_connector_writes_every_field(overhead_run):
    out = overhead_run.folder / "overhead.json"
    done = overhead_run.last
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert set(document) == {"plan", "machine", "runs", "summary", "overhead", "goal"}
    assert document["goal"] is None  # 10,000 waiting was not measured
    assert document["plan"]["connector"] == "on" and document["machine"]["vllm"] == "0.32.0"
    runs = {r["scheduler"]: r for r in document["runs"]}
    assert set(runs) == {"stock", "mars"}
    for run in runs.values():
        assert run["connector"] == "HostSwapConnector"  # loaded for stock too: a fair comparison
        assert run["steps"] == 5 and run["running"] == 8 and run["waiting_after"] == 12
        for key in (*STATS, "step_p50_ms", "start_s", "add_requests_s", "steps_s", "wall_s"):
            assert run[key] > 0, key
        assert run["wall_s"] > run["start_s"] + run["steps_s"]
        assert run["schedule_p50_ms"] <= run["schedule_p99_ms"] and run["total_p99_ms"] >= run["schedule_p99_ms"]
    assert runs["stock"]["snapshot_steps"] == 0 and runs["stock"]["snapshot_schedule_p50_ms"] is None
    # MarsScheduler publishes its state on the connector: at least in the first step (admissions)
    assert 1 <= runs["mars"]["snapshot_steps"] <= 5 and runs["mars"]["snapshot_schedule_p50_ms"] > 0
    assert [(s["waiting"], s["scheduler"]) for s in document["summary"]] == [(20, "stock"), (20, "mars")]
    (added,) = document["overhead"]
    assert added["same_batch"] is True
    for key in STATS:
        assert added[key] == pytest.approx(runs["mars"][key] - runs["stock"][key])
    assert "mars-stock" in done.stdout
