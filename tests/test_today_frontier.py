"""The trade-off table against today's baselines (`marsched.experiments.today_frontier`): each
variant scored as the goals read, against the best other policy at each load."""

from __future__ import annotations

import json
import sys

import pytest

from marsched.experiments import today_frontier
from marsched.experiments.today_frontier import SETS, Score, score, scores, table


def rec(policy: str, qps: float, mean: float, p99: float) -> dict:
    return {"policy": policy, "qps": qps, "e2e_mean_s": mean, "e2e_p99_s": p99}


def test_each_load_is_against_the_best_other_by_mean_and_by_p99_on_their_own():
    # At 1 qps the best mean is A's (10) and the best p99 is B's (30); at 2 qps both are B's.
    others = [rec("a", 1, 10, 40), rec("b", 1, 12, 30), rec("a", 2, 50, 90), rec("b", 2, 40, 80)]
    mars = {1: rec("mars", 1, 11, 33), 2: rec("mars", 2, 20, 84)}
    got = score(mars, others, (1, 2))
    assert got == Score(worst_mean=pytest.approx(1.1), top_mean=pytest.approx(0.5), worst_p99=pytest.approx(1.1))


def test_the_reference_engine_is_not_an_other_policy_and_missing_sets_are_left_out(tmp_path):
    s = SETS[-1]
    top = s.loads[-1]
    records = [rec(p, q, 10, 10) for p in ("infercept", "mars") for q in s.loads]
    records.append(rec("vllm-v0", top, 1, 1))  # faster than anything: it must not be the "best other"
    (tmp_path / f"{s.name}.json").write_text(json.dumps(records))
    (tmp_path / "frontier").mkdir()
    off = [rec("mars", q, 5, 20) for q in s.loads]
    (tmp_path / "frontier" / f"{s.name}-off.json").write_text(json.dumps(off))
    (tmp_path / "frontier" / f"{s.name}-fcfs4.json").write_text(json.dumps(off[:-1]))  # a load missing: left out

    got = scores(tmp_path)
    assert list(got) == [s.name]
    assert got[s.name]["fcfs-wait:2 (default)"] == Score(1.0, 1.0, 1.0)
    assert got[s.name]["off"] == Score(0.5, 0.5, 2.0)
    assert "fcfs-wait:4" not in got[s.name]
    rows = table(got).splitlines()
    assert rows[0] == f"| variant | {s.name} |"
    assert "| off | 0.50 / 0.50 / 2.00 / – |" in rows and "| fcfs-wait:4 |  |" in rows


def test_boost_reads_its_own_policy_the_bound_its_own_folder_and_slowdown_is_scored(tmp_path):
    s = SETS[-1]
    records = [dict(rec(p, q, 10, 10), slowdown_p99=4.0) for p in ("infercept", "mars") for q in s.loads]
    (tmp_path / f"{s.name}.json").write_text(json.dumps(records))
    (tmp_path / "frontier").mkdir()
    (tmp_path / "bound").mkdir()
    boost = [dict(rec("mars-boost", q, 8, 12), slowdown_p99=2.0) for q in s.loads]
    # a MARS record in the boost file is not boost's
    (tmp_path / "frontier" / f"{s.name}-boost0.01.json").write_text(json.dumps(boost + [rec("mars", s.loads[0], 1, 1)]))
    (tmp_path / "bound" / f"{s.name}.json").write_text(json.dumps([rec("mars", q, 5, 5) for q in s.loads]))

    got = scores(tmp_path)[s.name]
    assert got["mars-boost γ 0.01 (its default)"] == Score(0.8, 0.8, 1.2, 0.5)
    assert got["bound: told the future (default starvation)"] == Score(0.5, 0.5, 0.5, None)
    assert got["fcfs-wait:2 (default)"] == Score(1.0, 1.0, 1.0, 1.0)


def test_only_the_frontiers_own_variants_are_run_and_each_names_its_policy():
    from marsched.experiments.today_frontier import variants

    run_here = [v for v in variants() if v.runs_here]
    assert run_here and all(v.args[:2] == ("--policies", v.policy) for v in run_here)
    assert not any(v.folder == "bound" or not v.file for v in run_here)


def test_without_results_it_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(today_frontier, "ROOT", tmp_path)
    assert today_frontier.main([]) == 1
    assert "commands.sh" in capsys.readouterr().err
    assert today_frontier.main(["tables"]) == 2


def test_a_sets_compare_runs_its_trace_profile_scale_and_flags_as_the_commands_do(tmp_path):
    from marsched.experiments.today_frontier import TodaySet

    s = TodaySet("t", "single", "gptj-6b-a100", (3,), 0.5)
    s.compare(s.loads, ("--policies", "mars", "--starvation", "off"), tmp_path / "out.json")
    (r,) = json.loads((tmp_path / "out.json").read_text())
    assert (r["policy"], r["trace"], r["profile"], r["qps"], r["token_scale"]) == ("mars", "single", "gptj-6b-a100", 3, 0.5)
    assert (r["starvation"], r["duration_s"], r["seed"]) == ("off", 600.0, 0)


class _Recorded(today_frontier.TodaySet):
    """A set whose compare writes its flags instead of running (the runner is what is tested)."""

    def compare(self, loads, flags, out):
        if "fail" in flags:
            raise RuntimeError(f"{out.name} failed")
        out.write_text(json.dumps({"loads": list(loads), "flags": list(flags)}))


def test_the_runs_go_on_every_worker_each_once_with_a_progress_line(tmp_path, capsys):
    from marsched.experiments.today_frontier import Compare, run_compares

    s = _Recorded("t", "single", "gptj-6b-a100", (3, 4))
    todo = [Compare(f"run {i}", s, s.loads[-1:], ("--x", str(i)), tmp_path / f"{i}.json") for i in range(5)]
    run_compares(todo, workers=2)
    assert [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(5)] == [
        {"loads": [4], "flags": ["--x", str(i)]} for i in range(5)]
    err = capsys.readouterr().err.splitlines()
    assert [line.split("] ")[0] for line in err] == [f"[{k}/5" for k in range(1, 6)]  # counted as they end
    assert sorted(line.split("] ")[1] for line in err) == [f"run {i}" for i in range(5)]


def test_a_progress_line_comes_as_each_run_ends_not_when_all_have(tmp_path, monkeypatch):
    import io
    import threading

    from marsched.experiments.today_frontier import Compare, run_compares

    first_line = threading.Event()

    class Stderr(io.StringIO):
        def write(self, text):
            if "[1/2] first" in text:
                first_line.set()
            return super().write(text)

    class Waits(_Recorded):
        def compare(self, loads, flags, out):
            if flags == ("last",):  # ends only once the first run's line is out (or 10 s pass)
                out.write_text(json.dumps({"saw_first_line": first_line.wait(10)}))
            else:
                super().compare(loads, flags, out)

    monkeypatch.setattr(sys, "stderr", Stderr())
    s = Waits("t", "single", "gptj-6b-a100", (3,))
    run_compares([Compare("first", s, s.loads, (), tmp_path / "a.json"),
                  Compare("last", s, s.loads, ("last",), tmp_path / "b.json")], workers=2)
    assert json.loads((tmp_path / "b.json").read_text()) == {"saw_first_line": True}


def test_a_failed_run_stops_the_ones_not_started(tmp_path):
    from marsched.experiments.today_frontier import Compare, run_compares

    s = _Recorded("t", "single", "gptj-6b-a100", (3,))
    todo = [Compare("bad", s, s.loads, ("fail",), tmp_path / "bad.json")]
    todo += [Compare(f"run {i}", s, s.loads, (), tmp_path / f"{i}.json") for i in range(3)]
    with pytest.raises(RuntimeError, match="bad.json failed"):
        run_compares(todo, workers=1)
    assert not any((tmp_path / f"{i}.json").exists() for i in range(1, 3))


def test_an_unknown_variant_to_run_is_refused_with_the_known_ones(capsys):
    assert today_frontier.main(["run", "fcfs9"]) == 2
    err = capsys.readouterr().err
    assert "no set or variant fcfs9" in err and "boost0.01" in err and SETS[0].name in err


def test_run_runs_the_named_variants_on_the_named_sets_or_all_of_each_kind(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(today_frontier, "ROOT", tmp_path)
    monkeypatch.setattr(today_frontier, "run_compares", lambda todo: ran.extend((c.set.name, c.out.name) for c in todo))
    s = SETS[2].name
    today_frontier.run((s, "boost0.01", "off"))
    assert ran == [(s, f"{s}-off.json"), (s, f"{s}-boost0.01.json")]
    ran.clear()
    today_frontier.run(("nudge3",))
    assert ran == [(x.name, f"{x.name}-nudge3.json") for x in SETS]
    ran.clear()
    today_frontier.run((s,))
    assert len(ran) == len([v for v in today_frontier.variants() if v.runs_here]) and {x for x, _ in ran} == {s}
