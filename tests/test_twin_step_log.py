"""A live server's step log priced by the twin's step costs (`experiments/twin/step_log.py`)."""

from __future__ import annotations

import json
import random

import pytest

from marsched.experiments.twin import step_log
from marsched.policy.cost_model import attention_pairs
from marsched.sim.profile import load_profile

PROFILE = "results/twin/run9/profile.json"


def _line(tokens: int, seqs: int, ctx: int, pairs: int, seconds: float) -> str:
    return json.dumps({"t": 0.0, "sched_s": 1e-4, "update_s": 1e-4, "step_s": seconds, "tokens": tokens, "seqs": seqs,
                       "prefill_seqs": int(tokens > seqs), "ctx": ctx, "pairs": pairs})


def _log(tmp_path, slow_small: float = 1.0, count: int = 2000):
    """Steps timed at the profile's terms; decode steps `slow_small` times slower."""
    cost = load_profile(PROFILE).cost
    rng = random.Random(0)
    lines = [_line(0, 0, 0, 0, 0.001)]  # a step that computed nothing: skipped
    for _ in range(count):
        if rng.random() < 0.3:
            n, cached = rng.choice([128, 1024, 4096]), rng.choice([0, 4096, 16384])
            shape = (n, 1, cached + n, attention_pairs(n, cached))
            factor = 1.0
        else:
            b, ctx = rng.randint(1, 16), rng.randint(1000, 20000)
            shape = (b, b, b * ctx, b * ctx)
            factor = slow_small
        tokens, seqs, ctx, pairs = shape
        lines.append(_line(tokens, seqs, ctx, pairs, factor * cost.iteration_time(tokens, ctx, seqs, pairs)))
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n{\"t\": 1.0, \"step")  # the last line cut short
    return path


def test_steps_at_the_profiles_terms_are_priced_at_their_time_by_every_set(tmp_path):
    steps = step_log.read_steps(_log(tmp_path))
    assert len(steps) == 2000
    costs = {"profile": load_profile(PROFILE).cost, **step_log.fitted_terms(steps, 4096)}
    rows = {row.kind: row for row in step_log.priced(steps, costs)}
    assert set(rows) == {"decode", "chunk < 256", "chunk 256-2047", "chunk >= 2048", "all"}
    assert rows["all"].steps == 2000
    for row in rows.values():
        for name in step_log.TERM_SETS:
            assert row.priced_s[name] == pytest.approx(row.measured_s, rel=0.05), (row.kind, name)
    table = step_log.markdown(list(rows.values()))
    assert "| all | 2000 |" in table and "(1.00)" in table


def test_slow_decode_steps_move_the_fits_not_the_profile(tmp_path):
    steps = step_log.read_steps(_log(tmp_path, slow_small=2.0))
    costs = {"profile": load_profile(PROFILE).cost, **step_log.fitted_terms(steps, 4096)}
    decode = next(row for row in step_log.priced(steps, costs) if row.kind == "decode")
    assert decode.priced_s["profile"] / decode.measured_s == pytest.approx(0.5, rel=0.01)
    assert decode.priced_s["whole run"] / decode.measured_s > 0.7


def test_step_kinds():
    assert step_log.step_kind(8, 8) == "decode"
    assert step_log.step_kind(255, 1) == "chunk < 256"
    assert step_log.step_kind(256, 1) == "chunk 256-2047"
    assert step_log.step_kind(2048, 3) == "chunk >= 2048"


def test_bad_logs_are_named_by_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(10, 1, 10, 55, 0.01) + "\n" + json.dumps({"step_s": 0.01, "tokens": 5, "seqs": 1, "ctx": 5}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'pairs' must be a number >= 0, got None"):
        step_log.read_steps(bad)
    bad.write_text("[1, 2]\n" + _line(1, 1, 1, 1, 0.01) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a JSON object"):
        step_log.read_steps(bad)
    bad.write_text(_line(0, 0, 0, 0, 0.01) + "\n")
    with pytest.raises(ValueError, match="no step that computed tokens"):
        step_log.read_steps(bad)
    bad.write_text(_line(4, 4, 40, 40, 0.0) + "\n")
    with pytest.raises(ValueError, match="'step_s' must be > 0"):
        step_log.read_steps(bad)
    assert step_log.main([str(tmp_path / "missing.jsonl"), "--profile", PROFILE]) == 2
    assert "missing.jsonl: cannot read the step log" in capsys.readouterr().err
    assert step_log.main([str(bad), "--profile", PROFILE, "--token-budget", "0"]) == 2
    assert "--token-budget 0: give a number >= 1" in capsys.readouterr().err


def test_too_few_steps_to_fit_is_said(tmp_path, capsys):
    path = _log(tmp_path, count=10)
    assert step_log.main([str(path), "--profile", PROFILE]) == 2
    assert "too few to fit" in capsys.readouterr().err


def test_the_command_prints_the_table(tmp_path, capsys):
    assert step_log.main([str(_log(tmp_path)), "--profile", PROFILE]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| steps | count | measured s | profile s (÷ measured) |")
    assert "| chunk >= 2048 |" in out
