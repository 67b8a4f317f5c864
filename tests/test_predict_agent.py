"""The length predictor on agent turns: features as serving sees them, the split by session, the
evaluation, a smoke training run, the packaged `agent` head (`marsched.predict.agent_examples`,
`agent_train`, `batch_latency`).

Tests that run the MiniLM encoder or train need the `predict` extra; they carry the `predict`
marker and skip only where it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from marsched.predict.agent_examples import (
    FAMILIES,
    TAIL_CHARS,
    agent_examples,
    held_out_sessions,
    newest_text,
    reply_texts,
    session_folds,
    split_sessions,
    turn_type,
)
from marsched.loadgen.agent_text import load_agent_text
from marsched.predict.examples import Example
from marsched.predict.learned import default_head_dir, head_directory, packaged_head_dir
from marsched.workload.tokenizer import count_tokens

needs_extra = pytest.mark.predict


def _extra(*modules: str) -> None:
    missing = [m for m in ("all_minilm_l6_v2", "safetensors", *modules) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the predict extra is not installed ({', '.join(missing)})")


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    return agent_examples()


# --- the newest turn's text -------------------------------------------------------------------


def test_newest_text_is_what_the_prompt_adds():
    first = "system: you are an agent\nuser: fix the bug"
    reply = "THOUGHT: look\n```bash\nls\n```"
    second = first + reply + "\n<output>a.py b.py</output>"
    assert newest_text(first) == first  # a first turn: the prompt
    assert newest_text(second, first, reply) == "\n<output>a.py b.py</output>"
    # the reply is not in the new prompt: what follows the previous prompt
    assert newest_text(first + "\n<output>x</output>", first, reply) == "\n<output>x</output>"


def test_newest_text_skips_a_quoted_previous_reply_and_keeps_the_tail():
    reply = "the plan is: search the web"
    other_agent = "assistant: we are working on it. Last message: the plan is: search the web. Now: answer in JSON"
    assert newest_text(other_agent, "user: make a plan", reply) == ". Now: answer in JSON"
    assert newest_text("same prompt", "same prompt", "r") == "same prompt"  # adds nothing: the prompt itself
    long = "x" * 10 + "y" * TAIL_CHARS
    assert newest_text(long) == "y" * TAIL_CHARS  # a first turn: the prompt's end, its newest instruction
    assert newest_text("p" + long, "p", "") == long  # a follow-up: all it adds (the encoder reads its start)


def test_turn_types_are_family_by_first_or_follow_up():
    assert turn_type("miniswe", 0) == "miniswe:first"
    assert turn_type("magagent", 3) == "magagent:follow-up"


# --- examples from the bundled sessions ---------------------------------------------------------


def test_examples_are_every_turn_with_serving_features(examples):
    assert len(examples) == 402 + 746
    assert {e.source for e in examples} == set(FAMILIES)
    assert len({e.group for e in examples if e.source == "miniswe"}) == 20
    assert len({e.group for e in examples if e.source == "magagent"}) == 25
    previous_group = None
    for index, example in enumerate(examples):
        first = example.group != previous_group
        if first:
            assert example.previous_output_tokens == 0
            assert example.api_type.endswith(":first")
        else:
            # the previous reply is the previous turn's of the same session, nothing else's
            assert example.previous_output_tokens == examples[index - 1].output_tokens
            assert examples[index - 1].group == example.group
            assert example.api_type.endswith(":follow-up")
        assert example.output_tokens >= 1
        if first:
            assert len(example.last_turn) <= TAIL_CHARS  # the prompt's tail
        previous_group = example.group


def test_cut_examples_are_the_turns_as_loadgen_replays_them(examples):
    cut = agent_examples(["miniswe"], turn_chars=400)
    whole = [e for e in examples if e.source == "miniswe"]
    sessions = {s.key: s for s in load_agent_text(["miniswe"], 400)}
    assert [e.group for e in cut] == [e.group for e in whole]  # the same turns, the same split keys
    replayed = [turn.reply_tokens for key in dict.fromkeys(e.group for e in cut) for turn in sessions[key].turns]
    assert [e.output_tokens for e in cut] == replayed  # the replies loadgen forces
    assert all(len(e.last_turn) <= 400 for e in cut)  # the newest text is one cut piece
    assert max(e.output_tokens for e in cut) < max(e.output_tokens for e in whole)
    for index in range(1, len(cut)):
        if cut[index].group == cut[index - 1].group:
            assert cut[index].previous_output_tokens == cut[index - 1].output_tokens
    longer = agent_examples(["miniswe"], turn_chars=400, reply_chars=2000)  # as loadgen --reply-chars 2000
    sessions = {s.key: s for s in load_agent_text(["miniswe"], 400, 2000)}
    assert [e.output_tokens for e in longer] == [t.reply_tokens for key in dict.fromkeys(e.group for e in longer)
                                                 for t in sessions[key].turns]
    assert max(e.output_tokens for e in longer) > max(e.output_tokens for e in cut)
    assert all(len(e.last_turn) <= 400 for e in longer)  # the new texts are still cut to 400


def test_a_follow_up_reads_the_new_text_not_the_whole_prompt(examples):
    session = load_agent_text(["miniswe"])[0]
    replies = reply_texts("miniswe")[session.key]
    rows = [e for e in examples if e.group == session.key]
    assert [e.output_tokens for e in rows] == [t.reply_tokens for t in session.turns]
    assert rows[0].last_turn == session.turns[0].prompt.text[-TAIL_CHARS:]
    assert rows[0].context_tokens == count_tokens(session.turns[0].prompt.text)
    second = session.turns[1].prompt.text
    assert rows[1].context_tokens == count_tokens(second)
    assert rows[1].last_turn == newest_text(second, session.turns[0].prompt.text, replies[0])
    assert second.endswith(rows[1].last_turn) and len(rows[1].last_turn) < len(second) // 10  # the tool's result
    assert rows[1].last_turn_tokens == count_tokens(rows[1].last_turn)


# --- the split ------------------------------------------------------------------------------------


def test_the_split_holds_out_whole_sessions_of_both_families(examples):
    train, test = split_sessions(examples)
    train_sessions, test_sessions = {e.group for e in train}, {e.group for e in test}
    assert not train_sessions & test_sessions
    assert len(train) + len(test) == len(examples)
    for family, held in (("miniswe", 6), ("magagent", 8)):  # round(0.3 × 20), round(0.3 × 25)
        assert len({e.group for e in test if e.source == family}) == held
        assert any(e.source == family for e in train)
    again, _ = split_sessions(list(reversed(examples)))
    assert {e.group for e in again} == train_sessions  # fixed for a seed, whatever the order
    assert {e.group for e in split_sessions(examples, seed=1)[1]} != test_sessions


def test_folds_keep_sessions_whole_and_deal_each_family(examples):
    train, _ = split_sessions(examples)
    folds = session_folds(train, 1000, 4)
    fold_of: dict[str, int] = {}
    for example, fold in zip(train, folds):
        assert fold_of.setdefault(example.group, fold) == fold  # a session in one fold only
    for family in FAMILIES:
        assert {f for e, f in zip(train, folds) if e.source == family} == {0, 1, 2, 3}


def test_held_out_sessions_rounds_per_family():
    keys = [f"a:{i}" for i in range(10)] + [f"b:{i}" for i in range(3)]
    families = ["a"] * 10 + ["b"] * 3
    held = held_out_sessions(keys, families, 0, 0.3)
    assert len([k for k in held if k.startswith("a:")]) == 3 and len([k for k in held if k.startswith("b:")]) == 1


# --- evaluation, training, the packaged head ------------------------------------------------------


@needs_extra
def test_the_evaluation_reports_every_metric_for_the_head_and_baselines():
    _extra()
    from marsched.predict.agent_train import MAX_TOKENS, evaluate_agent

    result = evaluate_agent({"learned": packaged_head_dir("agent"), "default-head": default_head_dir()})
    names = {"learned", "default-head", "type-mean", "global-mean", "max_tokens"}
    assert set(result["all"]) == names
    for group in [result["all"], *result["by_source"].values()]:
        for report in group.values():
            assert {"acc5", "acc15", "mae_tokens", "kendall_tau", "n"} <= set(report)
    assert result["all"]["max_tokens"]["kendall_tau"] == 0.0  # a constant ranks nothing
    assert result["max_tokens"] == MAX_TOKENS and result["held_out_examples"] == result["all"]["learned"]["n"]
    assert len(result["split"]["held_out_sessions"]) == 14
    # the head trained on agent turns ranks them better than the one trained on ShareGPT
    assert result["all"]["learned"]["kendall_tau"] > result["all"]["default-head"]["kendall_tau"] + 0.1


def _tiny(family: str, session: int, turn: int) -> Example:
    words = "short answer please" if turn % 2 else "write a long detailed report with every section"
    length = 20 + 5 * session if turn % 2 else 400 + 10 * session
    return Example(family, f"{family}:{session}", words, 5, 100 + 50 * turn, turn_type(family, turn), length,
                   0 if turn == 0 else 1)


@needs_extra
def test_a_smoke_training_run_saves_a_head_that_loads(tmp_path):
    _extra("torch")
    from marsched.predict.agent_train import AgentDataset, AgentTrainConfig, train_agent
    from marsched.predict.learned import load_model

    rows = [_tiny(f, s, t) for f in ("fa", "fb") for s in range(6) for t in range(4)]
    data = AgentDataset(*split_sessions(rows))
    config = AgentTrainConfig(epochs=3, hidden=8, mixes=("alone",), folds=2)
    report = train_agent(tmp_path, config, data=data)
    assert report["chosen"] in ("bins/alone", "log/alone")
    assert set(report["cross_validation"]) == {"bins/alone", "log/alone"}
    assert all(m["n"] == len(data.train) for m in report["cross_validation"].values())  # every turn out of fold
    assert report["train_examples"] == len(data.train) and not set(report["train_sessions"]) & set(
        report["held_out_sessions"])
    model = load_model(str(tmp_path))
    assert model.head.meta["data"] == "agent-text" and model.head.meta["agent_train"]["epochs"] == 3
    assert (model.predict(["short answer please"], [100], [30]) >= 1).all()


def test_the_packaged_agent_head_is_named_small_and_trained_on_agent_turns():
    directory = packaged_head_dir("agent")
    assert directory is not None and head_directory("learned:agent") == directory
    assert head_directory("learned:default") == default_head_dir()
    assert head_directory("learned:./agent") == os.path.abspath("agent")  # a path stays a path
    assert packaged_head_dir("../heads") is None and packaged_head_dir("nope") is None
    assert os.path.getsize(os.path.join(directory, "head.npz")) < 1_000_000
    from marsched.predict.head import load_head

    head = load_head(directory)
    assert head.meta["data"] == "agent-text" and head.meta["previous_feature"] is True


@needs_extra
def test_batch_latency_times_batches_of_agent_turns(examples):
    _extra()
    from marsched.predict.batch_latency import batch_latency
    from marsched.predict.learned import load_model

    result = batch_latency(load_model(packaged_head_dir("agent")), examples, batch=8, batches=5)
    assert result["batch"] == 8 and result["batches"] == 5
    assert 0 < result["wall_p50_ms"] <= result["wall_p99_ms"] <= result["wall_max_ms"]
    assert len(result["load_average_before"]) == 3
    with pytest.raises(ValueError):
        batch_latency(load_model(packaged_head_dir("agent")), examples, batch=0)


def _marsched(*args):
    return subprocess.run([sys.executable, "-m", "marsched.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_cli_rejects_unknown_data_and_mixes(tmp_path):
    run = _marsched("predictor", "train", "--out", str(tmp_path / "h"), "--data", "tweets")
    assert run.returncode == 2 and "--data tweets" in run.stderr
    run = _marsched("predictor", "train", "--out", str(tmp_path / "h"), "--data", "agent-text", "--mixes", "some")
    assert run.returncode == 2 and "--mixes some" in run.stderr
    head = str(tmp_path)
    (tmp_path / "head.npz").write_bytes(b"")
    run = _marsched("predictor", "eval", head, "--turn-chars", "-1")
    assert run.returncode == 2 and "--turn-chars -1" in run.stderr
    run = _marsched("predictor", "eval", head, "--reply-chars", "2000")
    assert run.returncode == 2 and "--reply-chars 2000: only with --turn-chars" in run.stderr
    run = _marsched("predictor", "eval", head, "--turn-chars", "400")
    assert run.returncode == 2 and "only for --data agent-text" in run.stderr

