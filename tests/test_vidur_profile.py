"""The H100 profiles' derivation (`bench.vidur_profile`) on small Vidur-format tables worked by hand,
and the bundled profiles against the same formulas."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

from marsched.bench import vidur_profile as vp
from marsched.sim.profile import load_profile

OPS = vp.LAYER_OPERATORS  # nine operators per layer


def _mlp_csv(path: Path, rows: list[tuple[int, int, float]]) -> Path:
    """Rows of (tokens, TP, ms of every operator); the columns Vidur's mlp.csv has, in its order."""
    header = [f"time_stats.{op}.{stat}" for op in OPS for stat in ("min", "max", "mean", "median", "std")]
    header += ["n_head", "num_tokens", "num_tensor_parallel_workers"]
    lines = [",".join(header)]
    for tokens, tp, ms in rows:
        values = [str(ms if stat == "median" else 99.0) for _ in OPS for stat in ("min", "max", "mean", "median", "std")]
        lines.append(",".join([*values, "32", str(tokens), str(tp)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_operator_medians_per_token_count_at_one_parallel_degree(tmp_path):
    path = _mlp_csv(tmp_path / "mlp.csv", [(1, 1, 0.1), (1, 1, 0.3), (1, 1, 0.2), (8, 1, 0.4), (8, 2, 9.0)])
    times = vp.read_operator_times(path, 1)
    assert sorted(times) == [1, 8]
    assert times[1] == {op: pytest.approx(0.2) for op in OPS}  # median of 0.1, 0.3, 0.2
    assert times[8]["mlp_up_proj"] == 0.4  # the TP=2 row is another table
    assert vp.read_operator_times(path, 2)[8]["add"] == 9.0


def test_a_bad_table_names_the_file_and_the_row(tmp_path):
    path = _mlp_csv(tmp_path / "mlp.csv", [(1, 1, 0.1)])
    with pytest.raises(ValueError, match=r"mlp\.csv: no rows with num_tensor_parallel_workers = 4"):
        vp.read_operator_times(path, 4)
    path.write_text(path.read_text().replace(",32,1,1", ",32,one,1"))
    with pytest.raises(ValueError, match=r"mlp\.csv: row 2: ValueError"):
        vp.read_operator_times(path, 1)


def test_transfer_scales_each_operator_by_the_reference_ratio():
    target = {1: {op: 2.0 for op in OPS}, 8: {op: 3.0 for op in OPS}, 16: {op: 5.0 for op in OPS}}
    reference = {1: {op: 1.0 for op in OPS}, 8: {op: 2.0 for op in OPS}}
    elsewhere = {1: {op: 4.0 for op in OPS}, 8: {op: 3.0 for op in OPS}}
    moved = vp.transfer(target, reference, elsewhere)
    assert sorted(moved) == [1, 8]  # 16: the reference has no such count
    assert moved[1]["add"] == pytest.approx(2.0 * 1.0 / 4.0) and moved[8]["mlp_act"] == pytest.approx(3.0 * 2.0 / 3.0)


def test_an_iteration_is_layers_times_the_operators_and_two_all_reduces():
    times = {10: {op: 0.1 for op in OPS}}
    # 9 operators × 0.1 ms × 4 layers = 3.6 ms.
    assert vp.iteration_ms(times, layers=4) == {10: pytest.approx(3.6)}
    # All-reduces of 10 tokens × 100 hidden × 2 bytes = 2,000 bytes: halfway between the 1,000 and
    # 3,000-byte measurements, 0.2 ms, + 0.02 ms launch; two per layer: 4 × (0.9 + 2 × 0.22) = 5.36 ms.
    parallel = vp.Parallel([(1000.0, 0.1), (3000.0, 0.3)], hidden=100)
    assert vp.iteration_ms(times, layers=4, parallel=parallel) == {10: pytest.approx(5.36)}
    with pytest.raises(ValueError, match="outside the measured 1000-3000"):
        vp.all_reduce_ms(parallel.all_reduce, 4000)


def test_the_line_fit_recovers_c_and_a():
    fit = vp.fit_fixed_and_per_token({1: 5.02, 101: 7.02, 1001: 25.02})  # 5 ms + 0.02 ms/token
    assert (fit.intercept, fit.slope) == (pytest.approx(5.0), pytest.approx(0.02))
    assert fit.quality.relative_rms < 1e-9 and fit.quality.samples == 3


def test_the_line_fit_weighs_relative_errors():
    # A 2 ms step at 1 token among 20-80 ms ones: an unweighted fit gives it up (relative RMS 0.82),
    # minimising relative errors keeps it close (0.157).
    iteration = {1: 2.0, 1000: 20.0, 2000: 60.0, 4000: 80.0}
    fit = vp.fit_fixed_and_per_token(iteration)
    slope, intercept = np.polyfit(list(iteration), list(iteration.values()), 1)
    unweighted = np.sqrt(np.mean([((intercept + slope * n - ms) / ms) ** 2 for n, ms in iteration.items()]))
    assert fit.quality.relative_rms < 0.2 < 0.8 < unweighted


def test_the_bandwidth_and_flops_terms_by_hand():
    # LM head: 128,256 × 4,096 × 2 bytes = 1,050,673,152 bytes / 3.35 TB/s = 0.31363 ms; TP=4 reads a quarter each.
    assert vp.lm_head_read_ms(128_256, 4096, 1) == pytest.approx(0.313634, rel=1e-5)
    assert vp.lm_head_read_ms(128_256, 8192, 4) == pytest.approx(0.156817, rel=1e-5)
    # b: 2 × 32 × 8 × 128 × 2 = 131,072 bytes / 3.35 TB/s = 0.039126 µs; 70B TP=4: 81,920 bytes per GPU.
    assert vp.decode_read_us_per_token(32, 8, 128, 1) == pytest.approx(0.0391260, rel=1e-5)
    assert vp.decode_read_us_per_token(80, 8, 128, 4) == pytest.approx(0.0244537, rel=1e-5)
    # e: 4 × 128 × 32 heads × 32 layers = 524,288 FLOPs / 602 TFLOPs/s = 0.870910 ns; 70B: 655,360 per GPU.
    assert vp.attention_ns_per_pair(32, 32, 128, 1) == pytest.approx(0.870910, rel=1e-5)
    assert vp.attention_ns_per_pair(80, 64, 128, 4) == pytest.approx(1.088638, rel=1e-5)


def _checkout(root: Path) -> Path:
    compute, network = root / "data/profiling/compute", root / "data/profiling/network"
    # 8B: A100 Llama-3 twice the A100 Llama-2 everywhere, H100 Llama-2 half the A100's: H100 Llama-3 = A100 Llama-2.
    _mlp_csv(compute / "a100/meta-llama/Llama-2-7b-hf/mlp.csv", [(1, 1, 0.02), (1001, 1, 0.1)])
    _mlp_csv(compute / "h100/meta-llama/Llama-2-7b-hf/mlp.csv", [(1, 1, 0.01), (1001, 1, 0.05)])
    _mlp_csv(compute / "a100/meta-llama/Meta-Llama-3-8B/mlp.csv", [(1, 1, 0.04), (1001, 1, 0.2)])
    _mlp_csv(compute / "h100/meta-llama/Llama-2-70b-hf/mlp.csv", [(1, 4, 0.01), (1001, 4, 0.02), (1, 1, 7.0)])
    network.joinpath("h100_dgx").mkdir(parents=True)
    rows = ["rank,num_workers,size,collective,devices_per_node,time_stats.all_reduce.median",
            "0,4,16384,all_reduce,4,0.03", "0,4,16400384,all_reduce,4,0.13", "0,8,16384,all_reduce,8,5.0"]
    (network / "h100_dgx/all_reduce.csv").write_text("\n".join(rows) + "\n")
    return root


def test_derive_from_a_checkout(tmp_path):
    small, large = vp.derive(_checkout(tmp_path))
    # 8B: 32 layers × 9 ops × (0.02 ms at 1 token, 0.1 at 1,001): 5.76 and 28.8 ms: a = 0.02304, c = 5.73696.
    assert small.name == "llama3-8b-h100"
    assert (small.fit.intercept, small.fit.slope) == (pytest.approx(5.73696), pytest.approx(0.02304))
    assert small.c_ms == pytest.approx(5.73696 + 0.313634, rel=1e-5)
    # 70B: all-reduces of 1 and 1,001 tokens × 8,192 × 2 bytes (16,384 and 16,400,384: the two rows of
    # 4 workers) + 0.02 ms; 80 × (9 × 0.01 + 2 × 0.05) = 15.2 ms, 80 × (9 × 0.02 + 2 × 0.15) = 38.4 ms:
    # a = 0.0232, c = 15.1768 (the TP=1 row and the 8-worker row are other tables).
    assert (large.fit.intercept, large.fit.slope) == (pytest.approx(15.1768), pytest.approx(0.0232))
    assert large.name == "llama3-70b-4xh100"
    assert large.e_ns == pytest.approx(1.088638, rel=1e-5) and large.b_us == pytest.approx(0.0244537, rel=1e-5)
    assert json.loads(json.dumps(small.as_dict()))["iteration_ms_fixed"] == round(small.c_ms, 3)


def test_main_prints_both_profiles_or_its_usage(tmp_path, capsys):
    assert vp.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and f"{tmp_path / 'missing'}: not a directory" in err
    (tmp_path / "not-vidur").mkdir()
    assert vp.main([str(tmp_path / "not-vidur")]) == 2  # a directory without Vidur's files
    assert "mlp.csv: No such file or directory" in capsys.readouterr().err
    assert vp.main([str(_checkout(tmp_path))]) == 0
    names = [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()]
    assert names == ["llama3-8b-h100", "llama3-70b-4xh100"]


# --- the bundled profiles ---------------------------------------------------------------


def _data(name: str) -> dict:
    return json.loads((files("marsched.sim") / "profiles" / f"{name}.json").read_text())


@pytest.mark.parametrize("name, layers, heads, tp, vocab_hidden", [
    ("llama3-8b-h100", 32, 32, 1, 4096), ("llama3-70b-4xh100", 80, 64, 4, 8192)])
def test_the_bundled_h100_profiles_hold_the_derived_terms(name, layers, heads, tp, vocab_hidden):
    data, cost = _data(name), load_profile(name).cost
    assert data["iteration_ns_per_attention_pair"] == round(vp.attention_ns_per_pair(layers, heads, 128, tp), 3)
    assert data["iteration_us_per_context_token"] == round(vp.decode_read_us_per_token(layers, 8, 128, tp), 4)
    assert cost.seconds_per_attention_pair == pytest.approx(data["iteration_ns_per_attention_pair"] * 1e-9)
    # c is Vidur's intercept (in its source) plus the LM head's read.
    lm_head = vp.lm_head_read_ms(128_256, vocab_hidden, tp)
    intercept = float(re.search(r"intercept ([0-9.]+) ms", data["iteration_source"]).group(1))
    assert data["iteration_ms_fixed"] == pytest.approx(intercept + lm_head, abs=1e-3)
    assert f"{data['iteration_ms_per_token']} ms/token" in data["iteration_source"]
    for key in ("iteration_ns_per_attention_pair", "iteration_us_per_context_token", "iteration_ms_per_sequence"):
        assert len(data[f"{key}_source"]) > 60


def test_the_h100_profiles_use_vllm_v1_api_server_defaults_and_the_derived_capacity():
    small, large = load_profile("llama3-8b-h100"), load_profile("llama3-70b-4xh100")
    for profile in (small, large):
        assert (profile.cost.token_budget, profile.max_sequences, profile.block_tokens) == (8192, 1024, 16)
    # 8B: 131,072 bytes per token; (0.9 × 80 GB − 8.03e9 × 2) / (131,072 × 16) = 55.94e9 / 2,097,152 = 26,674 blocks.
    assert small.kv_bytes_per_token == 131_072 and small.device_blocks == 26_674
    # 70B: 327,680 bytes per token; (4 × 0.9 × 80 GB − 70.6e9 × 2) / (327,680 × 16) = 146.8e9 / 5,242,880 = 27,999.
    assert large.kv_bytes_per_token == 327_680 and large.device_blocks == 27_999
    # Links: 64 GB/s per direction per GPU: 488,281 tokens/s of 8B KV, 4 × 64 GB/s / 327,680 B = 781,250 for 70B.
    assert small.cost.swap_tokens_per_s == pytest.approx(64e9 / 131_072)
    assert large.cost.swap_tokens_per_s == pytest.approx(256e9 / 327_680)


# The prefill check (docs/profiles.md): a lone request of N prompt tokens on each profile, its
# time to first token as the simulator runs it, against the closed form and the recorded figures.
_PREFILL_S = {
    "llama3-8b-h100": {8192: 0.2010, 32768: 1.1566, 131072: 10.2686},
    "llama3-70b-4xh100": {8192: 0.5572, 32768: 2.6685, 131072: 17.7091},
}


@pytest.mark.parametrize("name", list(_PREFILL_S))
def test_simulated_prefill_of_8k_32k_128k(name):
    from marsched.policy import make_policy
    from simhelpers import single
    from test_engine_semantics import _run

    profile = load_profile(name)
    for tokens, recorded in _PREFILL_S[name].items():
        _, result, _ = _run([single("R", 0.0, tokens, 1)], make_policy("vllm", profile.cost), profile)
        ttft = result.records[0].ttft_s
        assert ttft == pytest.approx(profile.cost.prefill_time(tokens), rel=1e-12)
        assert ttft == pytest.approx(recorded, abs=1e-4)


# vLLM's published times to first token of a lone request, Llama-3.1-8B on one H100 (docs/profiles.md):
# its blog's KV-offloading post, Figure 1 (K read as 1,000), and its FP8 KV-cache post, Figure 2 (bf16).
_PUBLISHED_8B_TTFT_S = {10_000: 0.266, 30_000: 1.095, 100_000: 6.850, 32_768: 1.300, 131_072: 10.115}


def test_the_8b_profile_prefills_within_20_percent_of_vllms_published_times():
    cost = load_profile("llama3-8b-h100").cost
    for tokens, published in _PUBLISHED_8B_TTFT_S.items():
        assert cost.prefill_time(tokens) == pytest.approx(published, rel=0.20), tokens
