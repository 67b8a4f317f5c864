"""Profiles: what the bundled ones derive from their constants, and what a bad profile file gets."""

import json
from importlib.resources import files

import pytest

from marsched.sim.profile import load_profile, profile_from_dict, profile_names


def test_bundled_profiles_are_listed():
    assert profile_names() == ["gptj-6b-a100", "llama3-70b-4xh100", "llama3-8b-h100", "vicuna-13b-2xa100"]


def test_gptj_profile_derives_its_capacity_and_link_from_the_model_shape():
    p = load_profile("gptj-6b-a100")
    # K and V over 28 layers of 4096 in fp16: 2·28·4096·2 bytes per token.
    assert p.kv_bytes_per_token == 458_752
    # 40 GB × 0.9 minus 6.05e9 fp16 weights = 23.9e9 bytes, in blocks of 64 tokens (29,360,128 bytes).
    assert (p.block_tokens, p.device_blocks, p.device_tokens) == (64, 814, 52_096)
    assert (p.host_blocks, p.host_tokens) == (1089, 1089 * 64)  # 32 GB of host memory
    assert p.cost.swap_tokens_per_s == pytest.approx(25e9 / 458_752)
    assert (p.cost.seconds_per_token, p.cost.seconds_per_iteration, p.cost.token_budget) == (0.0408e-3, 0.01692, 384)
    assert (p.cost.seconds_per_context_token, p.cost.seconds_per_sequence) == pytest.approx((0.8e-6, 0.1e-3))
    assert p.name == "gptj-6b-a100" and "GPT-J" in p.description


def test_vicuna_profile_counts_both_gpus():
    p = load_profile("vicuna-13b-2xa100")
    assert p.kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert (p.device_blocks, p.device_tokens, p.host_blocks) == (877, 56_128, 2441)  # 2 × 40 GB × 0.9 − 26e9
    assert p.cost.swap_tokens_per_s == pytest.approx(50e9 / 819_200)


def _gptj() -> dict:
    return json.loads((files("marsched.sim") / "profiles" / "gptj-6b-a100.json").read_text())


def test_a_profile_file_by_path_and_its_defaults(tmp_path):
    data = _gptj()
    del data["name"], data["description"]
    data["host_swap_gb"] = 0  # no host memory is allowed
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    p = load_profile(str(path))
    assert p.name == str(path) and p.description == "" and p.host_blocks == 0 and p.device_blocks == 814


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("model"), "a profile is an object with a 'model' object"),
    (lambda d: d.update(model=[1]), "a profile is an object with a 'model' object"),
    (lambda d: d["model"].pop("layers"), "model: field 'layers' must be a number, got None"),
    (lambda d: d["model"].pop("kv_hidden_size"), "model: field 'kv_hidden_size' must be a number"),
    (lambda d: d["model"].pop("parameters"), "model: field 'parameters' must be a number"),
    (lambda d: d.pop("gpu_memory_utilization"), "field 'gpu_memory_utilization' must be a number"),
    (lambda d: d.pop("iteration_ms_per_token"), "field 'iteration_ms_per_token' must be a number"),
    (lambda d: d.pop("iteration_ms_fixed"), "field 'iteration_ms_fixed' must be a number"),
    (lambda d: d.pop("block_tokens"), "field 'block_tokens' must be a number"),
    (lambda d: d["model"].update(dtype_bytes=True), "field 'dtype_bytes' must be a number, got True"),
    (lambda d: d.update(gpus="1"), "field 'gpus' must be a number, got '1'"),
    (lambda d: d.update(gpu_memory_gb=float("inf")), "field 'gpu_memory_gb' must be a number"),
    (lambda d: d.update(token_budget=0), "field 'token_budget' must be > 0, got 0"),
    (lambda d: d.update(link_gb_per_s=-1), "field 'link_gb_per_s' must be > 0, got -1"),
    (lambda d: d.update(host_swap_gb=None), "field 'host_swap_gb' must be a number"),
    (lambda d: d["model"].update(parameters=2e10), "weights do not leave room for a KV cache"),
    (lambda d: d["model"].update(parameters=18e9), "weights do not leave room for a KV cache"),  # exactly none
])
def test_bad_profile_fields_are_named(change, message):
    data = _gptj()
    change(data)
    with pytest.raises(ValueError) as error:
        profile_from_dict(data, "my.json")
    assert str(error.value).startswith("my.json") and message in str(error.value)


def test_a_profile_that_is_not_an_object():
    with pytest.raises(ValueError, match="a profile is an object"):
        profile_from_dict([], "my.json")


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown profile 'h100'; valid: gptj-6b-a100, llama3-70b-4xh100, llama3-8b-h100, vicuna-13b-2xa100 \(or a path"):
        load_profile("h100")


def test_profile_file_with_bad_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=rf"{path}: not valid JSON"):
        load_profile(str(path))


def test_a_missing_json_path_is_an_unknown_profile(tmp_path):
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile(str(tmp_path / "absent.json"))


def test_partial_blocks_are_not_counted():
    data = _gptj()
    data["host_swap_gb"] = 0.02936  # 29,360,000 bytes: just under one 64-token block of 29,360,128
    assert profile_from_dict(data, "my.json").host_blocks == 0
    data["gpu_memory_gb"] = (6.05e9 * 2 + 29_360_000) / 0.9 / 1e9  # room for just under one block
    assert profile_from_dict(data, "my.json").device_blocks == 0


def _measured(**fields):
    data = _gptj()
    for key in ("gpus", "gpu_memory_gb", "gpu_memory_utilization", "host_swap_gb"):
        data.pop(key)
    data.update(fields)
    return data


def test_a_measured_profile_takes_one_device_block_and_no_host_blocks():
    p = profile_from_dict(_measured(device_blocks=1, host_blocks=0), "my.json")
    assert (p.device_blocks, p.host_blocks) == (1, 0)


@pytest.mark.parametrize("key", ["gpus", "gpu_memory_gb", "gpu_memory_utilization"])
def test_measured_and_derived_device_capacity_together_are_refused(key):
    data = _measured(device_blocks=10, host_blocks=0)
    data[key] = _gptj()[key]
    with pytest.raises(ValueError) as error:
        profile_from_dict(data, "my.json")
    assert str(error.value) == ("my.json: give either 'device_blocks' (measured) or 'gpus', 'gpu_memory_gb', "
                                f"'gpu_memory_utilization' (derived), not both; found {key!r}")
    data.update(gpus=1, gpu_memory_gb=80, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="not both; found 'gpus', 'gpu_memory_gb', 'gpu_memory_utilization'"):
        profile_from_dict(data, "my.json")


def test_an_optional_cost_term_may_be_zero_and_is_read_in_microseconds():
    data = _gptj()
    data["iteration_us_per_context_token"] = 0
    assert profile_from_dict(data, "my.json").cost.seconds_per_context_token == 0.0
    data["iteration_us_per_context_token"] = 3.0
    assert profile_from_dict(data, "my.json").cost.seconds_per_context_token == 3.0 / 1e6
    data["iteration_us_per_context_token"] = -1
    with pytest.raises(ValueError, match="field 'iteration_us_per_context_token' must be >= 0, got -1"):
        profile_from_dict(data, "my.json")
