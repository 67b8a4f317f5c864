"""The HTTP comparison harness (marsched.experiments.http_bench): the summary (medians, spread,
ratios) on fabricated loadgen reports, the interleaved order, the core-binding check, the servers'
commands; and one short live run of two configurations (`vllm` mark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marsched.experiments.http_bench import binding, configs, order, summary
from marsched.experiments.http_bench.__main__ import parse, plan_of
from marsched.experiments.http_bench.engine_queue import gauges, queue_stats
from marsched.experiments.http_bench.records import RunRecord
from marsched.experiments.http_bench.run import (INTERRUPTED_EXIT, MISMATCH_EXIT, RESUME_MISMATCH_EXIT, loadgen_command,
                                                 run_plan, write_summary)
from marsched.loadgen.session import Session, TextPrompt, Turn
from marsched.vllm.config import MarsConfig

# --- the summary ----------------------------------------------------------------------------------


def _report(path: Path, conv_mean: float, turn_mean: float, ttft: float, finished: int = 40, failed: int = 0) -> str:
    """A loadgen report with the fields the summary reads (the rest of the schema left out)."""
    path.write_text(json.dumps({
        "schema": "marsched.loadgen/1", "interrupted": False,
        "turns": {"finished": finished, "failed": failed, "e2e_mean_s": turn_mean, "e2e_p99_s": 3 * turn_mean,
                  "followup_ttft_mean_s": ttft},
        "conversations": {"e2e_mean_s": conv_mean, "e2e_p99_s": 2 * conv_mean},
    }))
    return str(path)


def _run(tmp_path: Path, config: str, repeat: int, conv_mean: float, **kwargs) -> RunRecord:
    path = tmp_path / f"{config}-r{repeat}.json"
    return RunRecord(config, repeat, loadgen=_report(path, conv_mean, conv_mean / 10, conv_mean / 100, **kwargs),
                     queue={"waiting_max": repeat})


def test_the_summary_takes_medians_and_spread_over_repeats(tmp_path):
    runs = [_run(tmp_path, "vllm-stock", r, v) for r, v in ((1, 30.0), (2, 10.0), (3, 14.0))]
    runs += [_run(tmp_path, "mars", r, v, failed=r) for r, v in ((1, 12.0), (2, 8.0))]
    result = summary.summarize(runs, ["vllm-stock", "mars"], {"note": "x"})
    stock = result["configs"]["vllm-stock"]["metrics"]
    assert stock["conv_e2e_mean_s"] == {"median": 14.0, "min": 10.0, "max": 30.0, "values": [30.0, 10.0, 14.0]}
    assert stock["conv_e2e_p99_s"]["median"] == 28.0 and stock["turn_e2e_mean_s"]["median"] == pytest.approx(1.4)
    assert stock["waiting_max"]["median"] == 2
    mars = result["configs"]["mars"]["metrics"]
    assert mars["conv_e2e_mean_s"]["median"] == 10.0  # of two: their mean
    assert mars["errors"] == {"median": 1.5, "min": 1, "max": 2, "values": [1, 2]}
    assert result["settings"] == {"note": "x"} and len(result["runs"]) == 5
    json.dumps(result, allow_nan=False)


def test_ratios_are_of_medians_against_stock_and_of_mars_against_the_best_other(tmp_path):
    runs = [_run(tmp_path, "vllm-stock", 1, 20.0), _run(tmp_path, "vllm", 1, 16.0),
            _run(tmp_path, "infercept", 1, 12.0), _run(tmp_path, "mars", 1, 9.0)]
    result = summary.summarize(runs, ["vllm-stock", "vllm", "infercept", "mars"], {})
    against_stock = result["ratios"]["vs_vllm-stock"]
    assert set(against_stock) == {"vllm", "infercept", "mars"}
    assert against_stock["mars"]["conv_e2e_mean_s"] == pytest.approx(9 / 20)
    assert against_stock["infercept"]["followup_ttft_mean_s"] == pytest.approx(12 / 20)
    best = result["ratios"]["mars_vs_best_other"]["conv_e2e_mean_s"]
    assert best == {"best": "infercept", "ratio": pytest.approx(9 / 12)}
    assert "turns_done" not in against_stock["mars"]  # counts get no ratio
    table = summary.markdown(result)
    assert "| mars / vllm-stock | 0.45 |" in table and "| mars / best other | 0.75 (infercept) |" in table


def test_the_oracle_diagnostic_is_never_the_best_other(tmp_path):
    runs = [_run(tmp_path, "infercept", 1, 12.0), _run(tmp_path, "mars", 1, 15.0),
            _run(tmp_path, "mars-oracle", 1, 6.0)]
    result = summary.summarize(runs, ["infercept", "mars", "mars-oracle"], {})
    assert result["ratios"]["mars_vs_best_other"]["conv_e2e_mean_s"] == {"best": "infercept",
                                                                        "ratio": pytest.approx(15 / 12)}
    assert result["configs"]["mars-oracle"]["metrics"]["conv_e2e_mean_s"]["median"] == 6.0


def test_runs_that_did_not_finish_are_counted_but_not_measured(tmp_path):
    good = _run(tmp_path, "vllm-stock", 1, 10.0)
    interrupted = _run(tmp_path, "vllm-stock", 2, 99.0)
    interrupted.interrupted = True
    failed = RunRecord("mars", 1, error="server exited with status 1")
    result = summary.summarize([good, interrupted, failed], ["vllm-stock", "mars"], {})
    assert result["configs"]["vllm-stock"]["runs"] == 1 and result["configs"]["vllm-stock"]["runs_failed"] == 1
    assert result["configs"]["vllm-stock"]["metrics"]["conv_e2e_mean_s"]["values"] == [10.0]
    assert result["configs"]["mars"]["metrics"]["conv_e2e_mean_s"]["median"] is None
    assert result["ratios"]["vs_vllm-stock"]["mars"]["conv_e2e_mean_s"] is None
    assert result["ratios"]["mars_vs_best_other"]["conv_e2e_mean_s"] == {"best": "vllm-stock", "ratio": None}
    assert "| mars | 0 (+1 failed) | – |" in summary.markdown(result)


# --- the order, the bindings, the commands ----------------------------------------------------------


def test_repeats_are_interleaved_and_each_starts_one_configuration_further():
    slots = order.run_order(["a", "b", "c"], 3)
    assert [(s.repeat, s.config) for s in slots] == [
        (1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b")]
    assert slots[3].label == "b-r2"
    assert [s.config for s in order.run_order(["x"], 2)] == ["x", "x"]
    with pytest.raises(ValueError, match="--repeats 0"):
        order.run_order(["a"], 0)


STOCK_LOG = """\
(EngineCore pid=29067) INFO 12-03 09:47:50 [ompmultiprocessing.py:185] OpenMP thread binding info: 
(EngineCore pid=29067) INFO 12-03 09:47:50 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False
(EngineCore pid=29067) INFO 12-03 09:47:50 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=1
(EngineCore pid=29067) INFO 12-03 09:47:50 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]
(EngineCore pid=29067) INFO 12-03 09:47:50 [ompmultiprocessing.py:185] \treserved_cpus=[1]
(EngineCore pid=29067) INFO 12-03 09:48:01 [kv_cache_utils.py:2327] CPU KV cache size: 5,120 tokens
"""


def test_the_core_binding_is_read_from_the_log_and_must_be_the_same_for_all():
    assert binding.core_binding(STOCK_LOG) == "local_rank=0, core ids=[0]; reserved_cpus=[1]"
    assert binding.core_binding("INFO no binding here\n") is None
    other = STOCK_LOG.replace("core ids=[0]", "core ids=[0, 1]").replace("reserved_cpus=[1]", "reserved_cpus=[]")
    same = binding.core_binding(STOCK_LOG)
    binding.check_same_binding({"vllm-stock-r1": same, "mars-r1": binding.core_binding(STOCK_LOG)})
    binding.check_same_binding({"a": None, "b": None})  # a GPU logs none
    with pytest.raises(binding.BindingMismatch, match=r"core ids=\[0, 1\]; reserved_cpus=\[\]: mars-r1"):
        binding.check_same_binding({"vllm-stock-r1": same, "mars-r1": binding.core_binding(other)})
    with pytest.raises(binding.BindingMismatch, match="no binding in the log"):
        binding.check_same_binding({"a": same, "b": None})


def test_every_server_gets_the_same_engine_and_only_the_scheduler_differs(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    engine = configs.Engine("/m", kv_blocks=33, seed=7, extra=("--dtype", "float32"), marsched_extra=("--no-swap",))
    commands = {c: configs.server_command(c, engine, 8000, 4.5) for c in configs.CONFIGS}
    tails = {c: command[-len(configs.vllm_options(engine)):] for c, command in commands.items()}
    assert all(t == configs.vllm_options(engine) for t in tails.values())
    assert tails["mars"][tails["mars"].index("--num-gpu-blocks-override") + 1] == "33"
    stock = commands["vllm-stock"]
    assert "marsched.cli" not in stock and stock[stock.index("--logits-processors") + 1].endswith(":BenchReplyLength")
    for name in ("vllm", "infercept", "continuum", "autellix", "mars"):
        assert "--bench-reply-lengths" in commands[name] and "--no-swap" in commands[name]
    # The host tier: stock vLLM's server and options with one connector more, the Swap connector's
    # host memory, and the cores stock vLLM computes on.
    host = commands["vllm-stock-host"]
    transfer = host.index("--kv-transfer-config")
    assert host[:2] == ["env", "VLLM_CPU_NUM_OF_RESERVED_CPU=1"]
    assert host[2:transfer] + host[transfer + 2:] == stock
    tier = json.loads(host[transfer + 1])
    assert (tier["kv_connector"], tier["kv_connector_module_path"]) == ("HostPrefixTierConnector",
                                                                        "marsched.vllm.prefix_tier")
    assert tier["kv_connector_extra_config"] == {"host_tokens": MarsConfig().host_swap_tokens}
    assert configs.DESCRIPTIONS["vllm-stock-host"].startswith("stock vLLM")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # a caller's choice binds every server alike
    assert configs.server_command("vllm-stock-host", engine, 8000, 4.5)[1] == "VLLM_CPU_NUM_OF_RESERVED_CPU=0"
    for name in ("vllm", "infercept", "autellix"):
        assert commands[name][commands[name].index("--policy") + 1] == name
        assert configs.DESCRIPTIONS[name].startswith(f"marsched serve --policy {name}")
    continuum = commands["continuum"]
    assert continuum[continuum.index("--policy") + 1] == "mars"
    assert continuum[continuum.index("--retention") + 1] == "fixed:4.5"
    assert "--policy" not in commands["mars"] and "--retention" not in commands["mars"]  # its defaults
    assert "--scheduler-cls" not in stock and "--scheduler-cls" not in host  # no meter asked for


def test_a_stock_server_runs_vllms_scheduler_with_the_step_meter_when_given_its_file(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    engine, meter = configs.Engine("/m"), tmp_path / "step_costs.json"
    for name in ("vllm-stock", "vllm-stock-host"):
        command = configs.server_command(name, engine, 8000, 4.5, meter)
        assert command[0] == "env" and f"MARSCHED_STEP_METER={meter}" in command[:3]
        assert command[command.index("--scheduler-cls") + 1] == "marsched.vllm.step_meter.MeteredScheduler"
        unmetered = configs.server_command(name, engine, 8000, 4.5)
        added = ["env"] if unmetered[0] != "env" else []  # the host tier's command sets a variable already
        assert [a for a in command if a not in unmetered] == [*added, f"MARSCHED_STEP_METER={meter}", "--scheduler-cls",
                                                              "marsched.vllm.step_meter.MeteredScheduler"]
    for name in ("vllm", "mars"):  # a marsched server shows its own costs: the file is not for it
        assert configs.server_command(name, engine, 8000, 4.5, meter) == configs.server_command(name, engine, 8000, 4.5)


def test_continuums_pin_is_twice_the_median_gap_as_replayed():
    sessions = [Session("s", tuple(Turn(TextPrompt("p"), 1, gap) for gap in (1.0, 2.0, 9.0, 50.0)))]
    assert configs.pin_seconds(sessions, 1.0, None) == 4.0  # gaps 1, 2, 9 (the last turn's is none)
    assert configs.pin_seconds(sessions, 1.0, 1.5) == 3.0  # capped: 1, 1.5, 1.5
    assert configs.pin_seconds([Session("t", (Turn(TextPrompt("p"), 1, 0.0),))], 1.0, None) == 1.0


def test_the_plan_passes_the_workload_to_loadgen_and_checks_the_flags(tmp_path):
    out = str(tmp_path / "o")  # --out must be a folder that can be made
    plan = plan_of(parse(["--model", "/m", "--out", out, "--configs", "vllm-stock,mars", "--rate", "0.25",
                          "--max-turns", "3", "--fixed-s", "2"]))
    command = loadgen_command(plan.load, "http://127.0.0.1:5", Path("/o/r.json"))
    pairs = dict(zip(command, command[1:]))
    assert pairs["--rate"] == "0.25" and pairs["--max-turns"] == "3" and pairs["--turn-chars"] == "400"
    assert pairs["--max-gap-s"] == "3.0" and "--token-scale" not in command and pairs["--out"] == "/o/r.json"
    claude = plan_of(parse(["--model", "/m", "--out", out, "--workload", "claude-code", "--token-scale", "0.02"]))
    assert claude.load.turn_chars == 0
    claude_command = loadgen_command(claude.load, "http://h:1", Path("r"))
    assert claude_command[claude_command.index("--token-scale") + 1] == "0.02" and "--turn-chars" not in claude_command
    assert "--oracle-predictions" not in command and "--reply-chars" not in command
    long = plan_of(parse(["--model", "/m", "--out", out, "--reply-chars", "2000"]))
    long_command = loadgen_command(long.load, "http://h:1", Path("r"))
    assert long_command[long_command.index("--reply-chars") + 1] == "2000" and long.load.turn_chars == 400
    oracle = plan_of(parse(["--model", "/m", "--out", out, "--configs", "infercept,mars,mars-oracle"]))
    assert oracle.configs == ("infercept", "mars", "mars-oracle")
    assert loadgen_command(oracle.load, "http://h:1", Path("r"), "mars-oracle")[-1] == "--oracle-predictions"
    assert "--oracle-predictions" not in loadgen_command(oracle.load, "http://h:1", Path("r"), "mars")
    assert configs.server_command("mars-oracle", configs.Engine("/m"), 1, 1.0) == \
        configs.server_command("mars", configs.Engine("/m"), 1, 1.0)
    for args, message in ((["--configs", "vllm,nope"], "unknown 'nope'"), (["--configs", "mars,mars"], "twice"),
                          (["--rate", "0"], "--rate 0"), (["--repeats", "0"], "--repeats 0"),
                          (["--turn-chars", "-1"], "--turn-chars -1"),
                          (["--out", "/dev/null"], "--out /dev/null: /dev/null is not a directory")):
        with pytest.raises(ValueError, match=message):
            plan_of(parse(["--model", "/m", "--out", out, *args]))


def test_queue_gauges_are_read_from_vllms_metrics_page():
    page = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75\n')
    assert gauges(page) == {"num_requests_waiting": 2.0, "num_requests_running": 3.0, "kv_cache_usage_perc": 0.75}
    stats = queue_stats([gauges(page), {"num_requests_waiting": 0.0}])
    assert (stats.waiting_max, stats.waiting_mean, stats.waiting_share, stats.running_max) == (2.0, 1.0, 0.5, 3.0)
    assert queue_stats([]).waiting_max is None


def _fake_runs(tmp_path: Path, stop_at: int, stop: BaseException):
    """A `run_slot` stand-in: measured runs with fabricated reports, then `stop` at run `stop_at`."""
    done = []

    def run(slot, plan, bindings):
        if len(done) + 1 == stop_at:
            raise stop
        bindings[slot.label] = "cores"
        done.append(slot.label)
        return _run(tmp_path, slot.config, slot.repeat, 10.0 + len(done))

    return run, done


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt(), INTERRUPTED_EXIT),
                                          (binding.BindingMismatch("cores differ"), MISMATCH_EXIT)])
def test_a_stopped_comparison_keeps_the_runs_that_finished(tmp_path, capsys, stop, status):
    plan = plan_of(parse(["--model", "/m", "--out", str(tmp_path / "out"), "--configs", "vllm-stock,mars",
                          "--repeats", "2", "--fixed-s", "1"]))
    run, done = _fake_runs(tmp_path, 3, stop)
    assert run_plan(plan, run) == status
    assert done == ["vllm-stock-r1", "mars-r1"]
    result = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["config"] for r in result["runs"]] == ["vllm-stock", "mars"]
    assert result["settings"]["order"] == ["vllm-stock-r1", "mars-r1", "mars-r2", "vllm-stock-r2"]
    assert "| mars | 1 |" in capsys.readouterr().out


def _plan(out: Path, *more: str):
    return plan_of(parse(["--model", "/m", "--out", str(out), "--configs", "vllm-stock,mars", "--repeats", "2",
                          "--fixed-s", "1", *more]))


def test_a_resumed_comparison_keeps_the_measured_runs_and_runs_the_rest(tmp_path, capsys):
    out = tmp_path / "out"
    first = _plan(out)
    kept = _run(tmp_path, "mars", 1, 7.0)
    kept.binding = "cores"
    failed = RunRecord("vllm-stock", 1, loadgen=None, error="the server did not start")
    for record in (kept, failed):
        folder = out / "runs" / f"{record.config}-r{record.repeat}"
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps(record.to_dict()))
    (out / "runs" / "mars-r2").mkdir()
    (out / "runs" / "mars-r2" / "run.json").write_text("{")  # cut off while written: run again
    write_summary(first, [kept, failed])
    run, done = _fake_runs(tmp_path, 0, KeyboardInterrupt())
    assert run_plan(_plan(out, "--resume"), run) == 0
    assert done == ["vllm-stock-r1", "mars-r2", "vllm-stock-r2"]  # the failed run again, the measured one kept
    result = json.loads((out / "summary.json").read_text())
    assert result["configs"]["mars"]["metrics"]["conv_e2e_mean_s"]["values"] == [7.0, 12.0]
    err = capsys.readouterr().err
    assert "[mars-r1] run 2 of 4: kept, measured earlier in" in err and "[vllm-stock-r1] run 1 of 4: stock" in err
    run, done = _fake_runs(tmp_path, 0, KeyboardInterrupt())
    assert run_plan(_plan(out), run) == 0 and len(done) == 4  # without --resume nothing is kept
    Path(kept.loadgen).unlink()  # its report is gone: nothing to keep
    (out / "runs" / "mars-r1" / "run.json").write_text(json.dumps(kept.to_dict()))
    run, done = _fake_runs(tmp_path, 0, KeyboardInterrupt())
    assert run_plan(_plan(out, "--resume", "--repeats", "1"), run) == 0 and done == ["vllm-stock-r1", "mars-r1"]


def test_a_comparison_with_a_run_that_did_not_measure_exits_1(tmp_path):
    def run(slot, plan, bindings):
        if slot.config == "mars":
            return RunRecord(slot.config, slot.repeat, loadgen=None, error="the server did not start")
        return _run(tmp_path, slot.config, slot.repeat, 10.0)

    assert run_plan(_plan(tmp_path / "out", "--repeats", "1"), run) == 1


def test_resuming_runs_of_other_settings_stops_before_any_run(tmp_path, capsys):
    out = tmp_path / "out"
    write_summary(_plan(out), [])
    run, done = _fake_runs(tmp_path, 0, KeyboardInterrupt())
    assert run_plan(_plan(out, "--resume", "--rate", "0.5"), run) == RESUME_MISMATCH_EXIT and done == []
    err = capsys.readouterr().err
    assert "STOPPED: --resume: the runs in" in err and "other load settings" in err and "'rate': 0.1" in err
    (out / "summary.json").write_text("[")
    assert run_plan(_plan(out, "--resume"), run) == RESUME_MISMATCH_EXIT and done == []
    assert "summary.json is unreadable, so the runs in" in capsys.readouterr().err
    assert run_plan(_plan(out), run) == 0 and len(done) == 4  # without --resume every run runs


# --- live -----------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_a_short_live_comparison_writes_the_summary_of_both_configurations(http_bench_run):
    out = http_bench_run.folder / "http"
    run = http_bench_run.last
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "summary.json").read_text())
    assert list(result["configs"]) == ["vllm-stock", "mars"]
    for entry in result["configs"].values():
        assert entry["runs"] == 1 and entry["metrics"]["turns_done"]["median"] > 0
        assert entry["metrics"]["errors"]["median"] == 0
    assert len({run["binding"] for run in result["runs"]}) == 1
    assert (out / "summary.md").read_text().startswith("| config | runs |")
    assert "| mars |" in run.stdout
    # Stock vLLM ran its own scheduler with the step meter beside it: the steps it timed are kept with
    # its run, as a marsched server's cost model is.
    stock = json.loads((out / "runs" / "vllm-stock-r1" / "run.json").read_text())
    assert "marsched.vllm.step_meter.MeteredScheduler" in stock["command"]
    assert stock["cost_model"] == json.loads((out / "runs" / "vllm-stock-r1" / "step_costs.json").read_text())
    assert stock["cost_model"]["steps"] > 0
    assert not (out / "runs" / "mars-r1" / "step_costs.json").exists()
