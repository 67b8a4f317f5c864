"""The bench-only scripted-reply processor (`marsched.loadgen.scripted_reply`): which reply a
prompt gets, the script file's errors, and the forced token. Claude Code's run against it is in
docs/clients.md."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from marsched.loadgen.scripted_reply import Script, force_tokens  # noqa: E402

SCRIPT = {"turn_marker": "<tool> ", "replies": ["[Bash(command='ls')]", "The files are listed above."]}


def test_the_turn_is_the_tool_results_in_the_prompt_capped_at_the_last_reply(tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    script = Script.load(path)
    assert script.reply_for("<system> you are claude\n<user> list the files\n<assistant> ") == 0
    assert script.reply_for("<user> ls\n<assistant> [Bash(command='ls')]\n<tool> notes.txt\n<assistant> ") == 1
    assert script.reply_for("<tool> a\n<tool> b\n<tool> c\n") == 1  # the last reply for every later turn


@pytest.mark.parametrize("text", ["not json", json.dumps({"replies": ["a"]}), json.dumps({"turn_marker": "x", "replies": []})])
def test_a_bad_script_names_its_file(tmp_path, text):
    path = tmp_path / "script.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="script.json"):
        Script.load(path)


def test_the_row_can_only_sample_the_scripted_token():
    logits = torch.randn(3, 16)
    other = logits[0].clone()
    force_tokens(logits, 1, 7)
    assert int(torch.argmax(logits[1])) == 7 and torch.isinf(logits[1]).sum() == 15
    assert torch.equal(logits[0], other)
