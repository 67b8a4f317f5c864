"""Session arrivals (`workload/sessions.py`): a conversation's tasks and how each follows the one
before, replayed closed-loop on the simulated cluster, with the next task taking back on its
replica the blocks the previous one left, and only the measured window counted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from marsched.bench.runner import RunSpec, run_one
from marsched.policy import make_policy
from marsched.sim.cluster import SESSION_SLICE_S, Routing, conversation_of, simulate_cluster
from marsched.sim.select import make_simulator
from marsched.workload import ApiCall, ApiType, build_request, poisson_arrivals, scale_tokens
from marsched.workload.model import FollowUp
from marsched.workload.sessions import SessionStream, conversations, session_arrivals
from simhelpers import COST, single, small_profile
from test_cli import marsched
from test_engine_semantics import Recorder
from test_workload_claude_code import BS, call, conversation, load, write


def chain(name: str = "c") -> list:
    """Three tasks of conversation `name`, starting 0, 100 and 300 s into it."""
    t0 = replace(single(f"{name}:t0", 0.0, 40, 5), conversation=name)
    t1 = replace(single(f"{name}:t1", 100.0, 60, 5), conversation=name, follows=FollowUp(f"{name}:t0", 50.0, 32))
    t2 = replace(single(f"{name}:t2", 300.0, 80, 5), conversation=name, follows=FollowUp(f"{name}:t1", 20.0, 48))
    return [t0, t1, t2]


# --- the loader ---------------------------------------------------------------------------


def test_each_task_knows_its_conversation_start_and_how_it_follows_the_one_before(tmp_path):
    first, second, third, fourth = load(tmp_path, conversation("c", [
        call(1000, 50, "end_turn", t=10.0),
        call(2000, 40, think=300.0, t=410.0), call(2100, 20, "end_turn", think=2.0, t=420.0),
        call(2500, 10, "end_turn", think=900.0, t=1400.0, prefix=20),
        call(2600, 10, "end_turn", t=1500.0)]))  # no think_time after an answer: the time since it
    assert {r.conversation for r in (first, second, third, fourth)} == {"c"}
    assert [r.arrival_s for r in (first, second, third, fourth)] == [0.0, 400.0, 1390.0, 1490.0]
    assert first.follows is None
    assert second.follows == FollowUp("c:t0", 300.0, (1000 // BS) * BS)
    assert third.follows == FollowUp("c:t1", 900.0, 20 * BS)
    assert fourth.follows == FollowUp("c:t2", 100.0, (2500 // BS) * BS)


def test_a_random_draw_shares_nothing_between_instances(tmp_path):
    templates = load(tmp_path, conversation("c", [call(1000, 50, "end_turn"), call(2000, 40, "end_turn", t=9.0)]))
    stream = poisson_arrivals(templates, qps=1.0, duration_s=30.0, seed=0)
    assert stream and all(r.conversation == "" and r.follows is None for r in stream)


def test_token_scaling_scales_the_shared_prompt_and_keeps_it_within_the_prompt():
    (_, t1, _) = chain()
    scaled = scale_tokens(replace(t1, follows=FollowUp("c:t0", 50.0, 40)), 0.5)
    assert scaled.follows == FollowUp("c:t0", 50.0, 20) and scaled.conversation == "c"
    over = scale_tokens(replace(t1, follows=FollowUp("c:t0", 50.0, 80)), 0.33)  # 26 of a 20-token prompt
    assert over.follows.shared_tokens == over.prompt_tokens == 20


def test_marsched_jsonl_keeps_conversations_and_names_a_bad_follows_field(tmp_path):
    from marsched.workload import TraceError, load_jsonl, save_jsonl

    assert load_jsonl(save_jsonl(chain(), tmp_path / "c.jsonl")) == chain()
    for follows, field, words in [
        ([], "follows", "JSON object"), ({"previous": "", "gap_s": 1, "shared_tokens": 0}, "follows.previous", "non-empty"),
        ({"previous": "p", "gap_s": -1, "shared_tokens": 0}, "follows.gap_s", ">= 0"),
        ({"previous": "p", "gap_s": 1}, "follows.shared_tokens", "missing"),
        ({"previous": "p", "gap_s": 1, "shared_tokens": 11}, "follows.shared_tokens", "more than the 10 prompt"),
        ({"previous": "p", "gap_s": 1, "shared_tokens": 1, "x": 0}, "follows.x", "unknown key"),
    ]:
        line = json.dumps({"id": "r", "prompt_tokens": 10, "segments": [{"output_tokens": 1}], "follows": follows})
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(TraceError) as caught:
            load_jsonl(tmp_path / "bad.jsonl")
        assert (caught.value.record, caught.value.field) == ("line 1 (request 'r')", field)
        assert words in caught.value.problem


# --- the stream ---------------------------------------------------------------------------


def test_conversations_are_the_chains_of_tasks_and_a_missing_previous_task_is_named():
    templates = chain("a") + chain("b")
    assert [[t.request_id for t in c] for c in conversations(templates)] == [
        ["a:t0", "a:t1", "a:t2"], ["b:t0", "b:t1", "b:t2"]]
    with pytest.raises(ValueError, match="'a:t2' follows 'a:t1', which is not a task"):
        conversations([t for t in templates if t.request_id != "a:t1"])


def test_a_stream_is_fixed_by_its_seed():
    one, two = (session_arrivals(chain(), 0.05, 2000.0, seed=3) for _ in range(2))
    assert [(r.request_id, r.arrival_s) for r in one.starts] == [(r.request_id, r.arrival_s) for r in two.starts]
    other = session_arrivals(chain(), 0.05, 2000.0, seed=4)
    assert [r.arrival_s for r in other.starts] != [r.arrival_s for r in one.starts]


def test_the_conversations_in_progress_at_zero_are_as_many_and_as_old_as_a_long_run_leaves_them():
    """At 0.5 conversations/s of a 300 s conversation, 150 are in progress on average, each at an
    age uniform over 0..300 s: a third before its second task, two thirds before its third."""
    stream = session_arrivals(chain(), 0.5, 400.0, seed=11)
    in_progress = [r for r in stream.starts if r.template_id != "c:t0"]  # new ones start with c:t0
    assert 110 <= len(in_progress) <= 190
    second = sum(r.template_id == "c:t1" for r in in_progress) / len(in_progress)
    assert 0.2 <= second <= 0.47
    assert all(0 <= r.arrival_s < 300.0 for r in in_progress)
    assert all(r.follows is None for r in in_progress)
    fresh = len(stream.starts) - len(in_progress)
    assert 150 <= fresh <= 250 and stream.sessions == len(stream.starts)  # 0.5/s over 400 s


def test_instances_have_their_own_ids_and_conversations_and_wait_for_their_previous_task():
    stream = session_arrivals(chain(), 0.01, 1000.0, seed=2)
    fresh = [r for r in stream.starts if r.template_id == "c:t0"]
    assert fresh
    for start in fresh:
        n = start.request_id.split("#")[1]
        assert start.conversation == f"c#{n}" and start.follows is None
        (follow_up,) = stream.held[f"c:t0#{n}"]
        assert follow_up.request_id == f"c:t1#{n}" and follow_up.conversation == f"c#{n}"
        assert follow_up.follows == FollowUp(f"c:t0#{n}", 50.0, 32)
    for start in (r for r in stream.starts if r.template_id != "c:t0"):  # joined mid-conversation
        assert start.follows is None  # its previous task never ran


def test_a_follow_up_comes_its_gap_after_the_end_and_none_at_or_past_the_horizon():
    stream = session_arrivals(chain(), 0.01, 1000.0, seed=2)
    n = next(r for r in stream.starts if r.template_id == "c:t0").request_id.split("#")[1]
    (follow_up,) = stream.follow_up(f"c:t0#{n}", 200.0)
    assert follow_up.arrival_s == 250.0
    assert stream.follow_up(f"c:t0#{n}", 200.0) == []  # taken once
    (late,) = stream.follow_up(f"c:t1#{n}", 300.0, not_before_s=330.0)
    assert late.arrival_s == 330.0  # 320 is past: it comes now
    stream.held["x"] = [replace(follow_up, follows=FollowUp("x", 5.0, 0))]
    assert stream.follow_up("x", 995.0) == []


@pytest.mark.parametrize("rate, horizon", [(0, 10.0), (-1, 10.0), (float("nan"), 10.0), (1.0, float("inf")),
                                           (True, 10.0)])
def test_bad_rates_and_horizons_are_errors(rate, horizon):
    with pytest.raises(ValueError, match="session arrivals: .* must be a finite number > 0"):
        session_arrivals(chain(), rate, horizon, seed=0)


# --- the engine: a conversation's blocks ------------------------------------------------------


def admits(requests, policy="mars"):
    trace = Recorder()
    make_simulator(requests, small_profile(), make_policy(policy, COST, prefix_cache=True), trace=trace).run()
    return {e["rid"]: e["prefill_tokens"] for e in trace.events if e["event"] == "admit"}


@pytest.mark.parametrize("policy", ["mars", "vllm"])
def test_the_next_task_takes_back_what_it_shares_with_the_previous_one_and_no_more(policy):
    """t0 computes 80 + 10 tokens (5 full blocks of 16) and ends; t1, 50 s later, shares its first
    48 tokens (3 blocks) with t0: it computes only the other 72 of its 120."""
    t0 = replace(single("c:t0#0", 0.0, 80, 11), conversation="c#0")
    t1 = replace(single("c:t1#0", 50.0, 120, 5), conversation="c#0", follows=FollowUp("c:t0#0", 50.0, 48))
    assert admits([t0, t1], policy)["c:t1#0"] == 120 - 48
    everything = replace(t1, follows=FollowUp("c:t0#0", 50.0, 120))
    assert admits([t0, everything], policy)["c:t1#0"] == 120 - 80  # what t0 left: 5 blocks
    strangers = [replace(t0, conversation=""), replace(t1, conversation="", follows=None)]
    assert admits(strangers, policy)["c:t1#0"] == 120
    other = replace(t1, conversation="d#0")
    assert admits([t0, other], policy)["c:t1#0"] == 120


# --- the cluster --------------------------------------------------------------------------


def two_tasks(gap_s: float) -> SessionStream:
    t0 = replace(single("c:t0#0", 0.0, 160, 11), conversation="c#0")
    t1 = replace(single("c:t1#0", 0.0, 200, 5), conversation="c#0", follows=FollowUp("c:t0#0", gap_s, 96))
    others = [replace(single(f"o{i}:t0#{i + 1}", 0.1 * i, 300, 20), conversation=f"o{i}#{i + 1}") for i in range(6)]
    return SessionStream([t0, *others], {"c:t0#0": [t1]}, horizon_s=100.0, sessions=7)


def cluster(stream, routing, window=None):
    replica = lambda: make_simulator([], small_profile(), make_policy("mars", COST, prefix_cache=True))  # noqa: E731
    return simulate_cluster(stream, replica, 3, routing, window=window)


@pytest.mark.parametrize("gap_s", [2.0, 0.1])
def test_a_follow_up_arrives_its_gap_after_its_previous_task_ended_at_most_a_slice_late(gap_s):
    records = {r.request_id: r for r in cluster(two_tasks(gap_s), Routing.ROUND_ROBIN).records}
    assert set(records) == {"c:t0#0", "c:t1#0", *(f"o{i}:t0#{i + 1}" for i in range(6))}
    ended = records["c:t0#0"].finish_s
    assert ended + gap_s <= records["c:t1#0"].arrival_s <= ended + max(gap_s, SESSION_SLICE_S)
    if gap_s > SESSION_SLICE_S:
        assert records["c:t1#0"].arrival_s == pytest.approx(ended + gap_s)


def test_affinity_sends_the_next_task_to_the_blocks_its_previous_task_left():
    affine = cluster(two_tasks(2.0), Routing.SESSION_AFFINE)
    assert sum(r.carried_blocks for r in affine.replicas) == sum(r.shared_blocks for r in affine.replicas) == 6
    spread = cluster(two_tasks(2.0), Routing.ROUND_ROBIN)  # t1 is the 8th arrival: another replica than t0's
    assert sum(r.carried_blocks for r in spread.replicas) == 0


def test_only_the_tasks_that_arrive_in_the_window_are_counted():
    result = cluster(two_tasks(2.0), Routing.ROUND_ROBIN, window=(0.15, 0.45))
    assert {r.request_id for r in result.records} == {"o2:t0#3", "o3:t0#4", "o4:t0#5"}
    assert result.arrived >= 3


def test_the_router_keys_on_the_conversation_a_session_task_names():
    assert conversation_of(replace(single("trace_0002:t3#7", 0.0, 1, 1), conversation="trace_0002#7")) == "trace_0002#7"


# --- runs and the command line ------------------------------------------------------------


def session_file(tmp_path):
    return write(tmp_path, *(conversation(f"c{i}", [
        call(1000 + 64 * i, 40, t=0.0), call(1300 + 64 * i, 30, "end_turn", think=3.0, t=5.0),
        call(1600 + 64 * i, 20, "end_turn", think=20.0, t=40.0),
        call(1800 + 64 * i, 10, "end_turn", think=30.0, t=90.0)]) for i in range(4)))


def test_a_session_run_counts_its_window_and_says_how_it_ran(tmp_path):
    spec = RunSpec("mars", qps=0.1, trace=str(session_file(tmp_path)), profile="llama3-8b-h100",
                   duration_s=60.0, arrivals="sessions", warmup_s=60.0, replicas=2, routing="mars-affine")
    record = run_one(spec)
    assert record["arrivals"] == "sessions" and record["warmup_s"] == 60.0 and record["sessions"] > 0
    assert record["num_finished"] == record["num_measured"] > 0
    assert record["num_requests"] > record["num_measured"]  # the warm-up and what came after the window
    assert 0 < record["carried_tokens"] <= min(record["shared_tokens"], record["reused_tokens"])
    again = run_one(spec)
    assert {k: v for k, v in again.items() if k != "wallclock_s"} == {k: v for k, v in record.items() if k != "wallclock_s"}


@pytest.mark.parametrize("changes, words", [
    ({"arrivals": "closed"}, "--arrivals 'closed': give one of poisson, sessions"),
    ({"arrivals": "sessions", "warmup_s": -1.0}, "--warmup -1.0: give a number of seconds >= 0"),
    ({"warmup_s": 10.0}, "--warmup applies to --arrivals sessions only"),
    ({"arrivals": "sessions", "trace_out": "t.jsonl"}, "--trace-out cannot be given with --arrivals sessions"),
])
def test_bad_session_options_are_errors(changes, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        replace(RunSpec("mars", qps=1.0), **changes).build()


def test_the_command_line_names_a_bad_arrivals_option():
    run = marsched("simulate", "--arrivals", "closed", "--duration", "5")
    assert run.returncode != 0 and "--arrivals 'closed'" in run.stdout + run.stderr


@pytest.mark.parametrize("value", ["0", "-2", "nan"])
def test_the_command_line_names_a_bad_kv_scale(tmp_path, value):
    out = tmp_path / "out.json"
    run = marsched("simulate", "--kv-scale", value, "--duration", "5", "--json", str(out))
    assert run.returncode == 2 and "--kv-scale" in run.stderr and "give a finite number > 0" in run.stderr
    assert not out.exists()


def test_kv_scale_reaches_the_run_and_its_record(tmp_path):
    records = {}
    for scale in ("1", "4"):
        out = tmp_path / f"kv{scale}.json"
        run = marsched("simulate", "--trace", str(session_file(tmp_path)), "--profile", "llama3-8b-h100",
                       "--arrivals", "sessions", "--qps", "0.1", "--duration", "60", "--warmup", "60",
                       "--replicas", "2", "--kv-scale", scale, "--json", str(out))
        assert run.returncode == 0, run.stderr
        records[scale] = json.loads(out.read_text())[0]
    assert records["1"]["kv_scale"] == 1.0 and records["4"]["kv_scale"] == 4.0
    assert records["1"]["num_measured"] > 0 and records["4"]["num_measured"] > 0
