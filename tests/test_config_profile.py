"""The vLLM plugin's cost model from a profile: `MarsConfig(profile=...)`, `serve`/`bench --profile` (no vLLM)."""

from __future__ import annotations

import json

import pytest

from marsched.bench.real import BenchSpec
from marsched.policy.nudge import DEFAULT_NUDGE_M
from marsched.sim.profile import load_profile
from marsched.vllm.config import CostSettings, MarsConfig

MEASURED = {
    "name": "measured", "model": {"layers": 4, "kv_hidden_size": 128, "dtype_bytes": 2},
    "device_blocks": 2047, "host_blocks": 4096, "block_tokens": 128, "token_budget": 2048,
    "iteration_ms_fixed": 2.5, "iteration_ms_per_token": 0.05, "iteration_us_per_context_token": 0.14,
    "iteration_ms_per_sequence": 0.1, "link_gb_per_s": 8.0,
}


@pytest.fixture
def measured(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(MEASURED))
    return path


def test_a_profile_file_replaces_the_placeholder_costs(measured):
    config = MarsConfig(profile=str(measured))
    cost = config.cost_model(token_budget=512)
    expected = load_profile(str(measured)).cost
    assert cost.seconds_per_iteration == pytest.approx(2.5e-3) and cost.seconds_per_token == pytest.approx(5e-5)
    assert cost.swap_tokens_per_s == expected.swap_tokens_per_s  # 8 GB/s over 2,048 bytes per token
    assert cost.token_budget == 512  # the engine's own budget
    for field in ("seconds_per_context_token", "seconds_per_sequence"):  # once CostModel has them
        if hasattr(expected, field):
            assert getattr(cost, field) == getattr(expected, field) > 0
    assert config.build_policy(token_budget=512).cost == cost


def test_a_bundled_profile_by_name_and_the_round_trip_through_vllms_config():
    config = MarsConfig(policy="infercept", profile="gptj-6b-a100")
    assert config.cost_model(384).seconds_per_token == load_profile("gptj-6b-a100").cost.seconds_per_token
    extra = config.additional_config()
    assert extra["marsched"]["profile"] == "gptj-6b-a100"
    assert MarsConfig.from_dict(json.loads(json.dumps(extra["marsched"]))) == config

    class FakeVllmConfig:
        additional_config = extra

    assert MarsConfig.from_vllm_config(FakeVllmConfig()).profile == "gptj-6b-a100"


def test_without_a_profile_the_cost_settings_still_apply():
    cost = MarsConfig(cost=CostSettings(seconds_per_token=1e-4)).cost_model(token_budget=64)
    assert cost.seconds_per_token == 1e-4 and cost.token_budget == 64


@pytest.mark.parametrize("value, message", [
    ("missing.json", "marsched config 'profile': no profile file missing.json"),
    ("/nowhere/p", "marsched config 'profile': no profile file /nowhere/p"),
    ("gptj", "marsched config 'profile': unknown profile 'gptj'; valid: gptj-6b-a100"),
    ("", "marsched config 'profile': give a profile name or a .json path"),
])
def test_a_bad_profile_is_an_error_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        MarsConfig(profile=value)
    with pytest.raises(ValueError, match=message):
        MarsConfig.from_dict({"profile": value})


def test_a_bad_field_in_the_profile_names_the_file_and_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**MEASURED, "iteration_ms_fixed": "fast"}))
    with pytest.raises(ValueError, match=f"marsched config 'profile': {path}: field 'iteration_ms_fixed' must be"):
        MarsConfig(profile=str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MarsConfig(profile=str(path))


def test_profile_and_cost_together_are_refused(measured):
    with pytest.raises(ValueError, match="either 'profile' .* or 'cost', not both"):
        MarsConfig.from_dict({"profile": str(measured), "cost": {"seconds_per_token": 1e-3}})


def test_bench_spec_checks_its_profile(measured):
    BenchSpec("m", profile=str(measured)).check()
    with pytest.raises(ValueError, match="--profile nope.json: no profile file nope.json"):
        BenchSpec("m", profile="nope.json").check()


# --- the commands ---------------------------------------------------------------------------------

from typer.testing import CliRunner  # noqa: E402

from marsched.cli import app  # noqa: E402


def test_serve_passes_an_absolute_profile_path_to_the_plugin(measured, monkeypatch):
    import marsched.serve as serve_package

    seen = {}

    def fake_serve(options, echo):
        seen["options"] = options
        return 0

    monkeypatch.setattr(serve_package, "serve", fake_serve)
    monkeypatch.chdir(measured.parent)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    result = CliRunner().invoke(app, ["serve", "m", "--profile", measured.name, "--predictor", "oracle"])
    assert result.exit_code == 0, result.output
    mars = seen["options"].mars
    assert mars.profile == str(measured) and mars.cost == CostSettings()


def test_serve_runs_mars_boost_and_autellix_with_their_settings(monkeypatch):
    import marsched.serve as serve_package

    seen = []

    def fake_serve(options, echo):
        seen.append(options.mars)
        return 0

    monkeypatch.setattr(serve_package, "serve", fake_serve)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    for args in (["--policy", "mars-boost", "--boost-gamma", "0.5"], ["--policy", "autellix"]):
        result = CliRunner().invoke(app, ["serve", "m", "--predictor", "oracle", *args])
        assert result.exit_code == 0, result.output
    boost, autellix = (mars.build_policy(token_budget=256) for mars in seen)
    assert (boost.name, boost.boost_gamma, autellix.name) == ("mars-boost", 0.5, "autellix")
    result = CliRunner().invoke(app, ["serve", "m", "--predictor", "oracle", "--policy", "mars-boost",
                                      "--boost-gamma", "0"])
    assert result.exit_code == 2 and "--boost-gamma" in result.output
    with pytest.raises(ValueError, match="'boost_gamma': give a number > 0"):
        MarsConfig(policy="mars-boost", boost_gamma=-1.0)


def test_serve_runs_mars_nudge_with_its_window(monkeypatch):
    import marsched.serve as serve_package

    seen = []
    monkeypatch.setattr(serve_package, "serve", lambda options, echo: seen.append(options.mars) or 0)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    for args in (["--policy", "mars-nudge", "--nudge-m", "5"], ["--policy", "mars-nudge"]):
        result = CliRunner().invoke(app, ["serve", "m", "--predictor", "oracle", *args])
        assert result.exit_code == 0, result.output
    given, default = (mars.build_policy(token_budget=256) for mars in seen)
    assert (given.name, given.nudge_m, default.nudge_m) == ("mars-nudge", 5, DEFAULT_NUDGE_M)
    assert given.ranks_by_program_arrival and not given.starvation.enabled
    assert MarsConfig.from_dict(seen[0].to_dict()).nudge_m == 5  # as the engine process reads it
    result = CliRunner().invoke(app, ["serve", "m", "--predictor", "oracle", "--policy", "mars-nudge",
                                      "--nudge-m", "0"])
    assert result.exit_code == 2 and "--nudge-m 0" in result.output
    for m in (0, 2.0, True):
        with pytest.raises(ValueError, match="'nudge_m': give a whole number >= 1"):
            MarsConfig(policy="mars-nudge", nudge_m=m)


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope.json"], "--profile nope.json: no profile file nope.json"),
    (["--profile", "gptj-6b-a100", "--seconds-per-token", "0.001"], "drop --seconds-per-token"),
])
def test_serve_refuses_a_bad_profile(args, message):
    result = CliRunner().invoke(app, ["serve", "m", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_bench_refuses_a_bad_profile(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 128,
                                                      "num_hidden_layers": 2, "vocab_size": 512}))
    result = CliRunner().invoke(app, ["bench", "--model", str(tmp_path), "--profile", "nope.json"])
    assert result.exit_code == 2 and "--profile nope.json: no profile file" in " ".join(result.output.split())


@pytest.mark.parametrize("args, message", [
    (["--prefill-tokens", "64,x"], "--prefill-tokens '64,x': give comma-separated whole numbers"),
    (["--prefill-tokens", "64"], "--prefill-tokens: give at least two sizes"),
    (["--decode-steps", "1"], "--decode-steps 1: give at least 3"),
])
def test_calibrate_names_a_bad_flag(tmp_path, args, message):
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "p.json"), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_calibrate_refuses_a_missing_model_and_an_existing_out(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "no config.json there" in " ".join(result.output.split())
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 128,
                                                      "num_hidden_layers": 2, "vocab_size": 512}))
    (tmp_path / "p.json").write_text("{}")
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "exists; add --force" in " ".join(result.output.split())


def test_the_simulator_only_policy_is_refused_in_vllm_and_by_bench():
    with pytest.raises(ValueError, match="infercept-code runs only in the simulator"):
        MarsConfig(policy="infercept-code")
    with pytest.raises(ValueError, match="--policies infercept-code: runs only in the simulator"):
        BenchSpec("model", policies=("vllm", "infercept-code")).check()


def test_every_simulator_only_policy_is_refused_on_vllm_with_what_to_use_instead():
    from marsched.policy.registry import SIMULATOR_ONLY
    assert {"infercept-code", "vllm-v0", "vllm-offload", "continuum", "continuum-public"} <= SIMULATOR_ONLY
    assert not {"autellix", "mars-boost", "mars-nudge"} & SIMULATOR_ONLY  # their programs' state is kept over HTTP too
    for name, instead in (("continuum", None), ("vllm-offload", "vllm"), ("infercept-code", "infercept")):
        with pytest.raises(ValueError) as error:
            MarsConfig(policy=name)
        assert f"{name} runs only in the simulator" in str(error.value)
        assert (f"on vLLM use {instead}" in str(error.value)) == (instead is not None)
        with pytest.raises(ValueError, match=f"--policies {name}: runs only in the simulator"):
            BenchSpec("model", policies=(name,)).check()
