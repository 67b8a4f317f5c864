"""What `marsched serve` learned of its cost model, beside what `marsched calibrate` fitted on the same engine.

Against a running `marsched serve` (no --profile), it first sends calibrate's kinds of steps:
lone prefills of given sizes and batches of requests decoding together at given contexts
(prompts as token ids, so the sizes are exact; `ignore_eos`, so the decodes run their length).
Then it reads `/marsched/state`'s `cost_model` and the calibrated profile, and writes both
constant by constant, with each model's time for every step calibrate measured (its medians)
and the relative error against the measurement.

    .venv/bin/python scripts/cost_model_compare.py --server http://127.0.0.1:8000 \
        --profile results/cost-model/calibrated-tiny.json --out results/cost-model/comparison.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from marsched.policy.cost_model import CostModel, attention_pairs
from marsched.policy.learned_cost import terms_of
from marsched.sim.profile import load_profile

TERMS = ("seconds_per_iteration", "seconds_per_token", "seconds_per_context_token", "seconds_per_sequence",
         "seconds_per_attention_pair")
TOKEN_ID = 7  # any id of the tiny model's vocabulary that is not a special token


def _complete(client: httpx.Client, server: str, model: str, prompt_tokens: int, max_tokens: int) -> None:
    response = client.post(f"{server}/v1/completions", json={
        "model": model, "prompt": [TOKEN_ID] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0})
    if response.status_code != 200:
        sys.exit(f"{server}: a completion of {prompt_tokens} prompt tokens failed: {response.text[:500]}")


def keep_as_swap(client: httpx.Client, server: str, model: str, prompt_tokens: int, conversation: str) -> None:
    """A conversation turn kept as Swap (its KV copied to the host), then released: copies for the link's rate."""
    marsched = json.dumps({"conversation": conversation, "strategy": "swap", "tool_s": 30.0})
    response = client.post(f"{server}/v1/completions", json={
        "model": model, "prompt": [TOKEN_ID] * prompt_tokens, "max_tokens": 2, "ignore_eos": True,
        "vllm_xargs": {"marsched": marsched}})
    if response.status_code != 200:
        sys.exit(f"{server}: a conversation turn of {prompt_tokens} tokens failed: {response.text[:500]}")
    time.sleep(0.5)  # the copy is made in the steps after the turn ends
    client.delete(f"{server}/marsched/conversations/{conversation}")


def drive(server: str, model: str, prefill: list[int], batches: list[int], contexts: list[int], decode_tokens: int,
          rounds: int, swap_tokens: list[int]) -> None:
    """Prefills one at a time, then each batch × context decoding together, then turns kept as Swap,
    `rounds` times."""
    with httpx.Client(timeout=600) as client:
        for round_ in range(rounds):
            for tokens in swap_tokens:
                keep_as_swap(client, server, model, tokens, f"cost-model-{round_}-{tokens}")
            for tokens in prefill:
                _complete(client, server, model, tokens, 1)
            for batch in batches:
                for context in contexts:
                    threads = [threading.Thread(target=_complete, args=(client, server, model, context, decode_tokens))
                               for _ in range(batch)]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()


def learned_state(server: str) -> dict:
    state = httpx.get(f"{server}/marsched/state", timeout=30).json()
    scheduler = state.get("scheduler") or state["ranks"][0]["scheduler"]
    return scheduler["cost_model"]


def _time(terms: tuple[float, ...], sample: dict) -> float:
    row = (1.0, sample["new_tokens"], sample["context_tokens"], sample["sequences"], sample.get("attention_pairs", 0))
    return sum(t * x for t, x in zip(terms, row))


def _pairs(sample: dict, kind: str) -> int:
    """A sample's attention pairs, as calibrate counts them, where its profile has none stored."""
    if "attention_pairs" in sample:
        return sample["attention_pairs"]
    if kind == "prefill":
        return attention_pairs(sample["new_tokens"], 0)
    return sample["context_tokens"]  # a decode step pairs each new token with its context


def compare(profile_path: str, learned: dict) -> dict:
    profile = load_profile(profile_path)
    calibrated: CostModel = profile.cost
    raw = json.loads(Path(profile_path).read_text())
    measured = raw["measurements"]
    cal_terms = terms_of(calibrated)
    learned_terms = tuple(learned[name] for name in TERMS)
    samples = []
    for kind in ("prefill", "decode"):
        for sample in measured[kind]:
            sample = {**sample, "attention_pairs": _pairs(sample, kind)}
            cal, lrn = _time(cal_terms, sample), _time(learned_terms, sample)
            samples.append({"kind": kind, **{k: sample[k] for k in ("new_tokens", "context_tokens", "sequences",
                                                                      "attention_pairs")},
                            "measured_s": sample["seconds"], "calibrate_s": cal, "learned_s": lrn,
                            "calibrate_error": cal / sample["seconds"] - 1, "learned_error": lrn / sample["seconds"] - 1})

    def rms(key: str) -> float:
        return math.sqrt(statistics.fmean(s[key] ** 2 for s in samples))

    return {
        "terms": {name: {"calibrate": cal, "learned": lrn, "learned_over_calibrate": lrn / cal if cal else None}
                  for name, cal, lrn in zip(TERMS, cal_terms, learned_terms)},
        "swap_tokens_per_s": {"calibrate": calibrated.swap_tokens_per_s, "learned": learned["swap_tokens_per_s"],
                              "learned_over_calibrate": learned["swap_tokens_per_s"] / calibrated.swap_tokens_per_s},
        "learned": learned,
        "calibrate": {"profile": profile_path, "load_average": measured.get("load_average"),
                      "fit": measured.get("fit")},
        "on_calibrate_medians": {"samples": samples, "calibrate_relative_rms": rms("calibrate_error"),
                                 "learned_relative_rms": rms("learned_error")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the marsched serve URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--profile", required=True, help="the profile `marsched calibrate` wrote")
    parser.add_argument("--out", required=True, help="the comparison JSON")
    parser.add_argument("--model", help="the served model name (default: the server's first)")
    parser.add_argument("--prefill", default="32,128,512,1024")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--contexts", default="64,512")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--swap-tokens", default="512,1024", help="prompt tokens of the turns kept as Swap")
    parser.add_argument("--no-drive", action="store_true", help="only read what the server learned so far")
    args = parser.parse_args()
    if not Path(args.profile).is_file():
        sys.exit(f"--profile {args.profile}: no such file")
    ints = {name: [int(v) for v in getattr(args, name).split(",")]
            for name in ("prefill", "batches", "contexts", "swap_tokens")}
    model = args.model or httpx.get(f"{args.server}/v1/models", timeout=30).json()["data"][0]["id"]
    started = time.time()
    load_before = os.getloadavg()
    if not args.no_drive:
        drive(args.server, model, ints["prefill"], ints["batches"], ints["contexts"], args.decode_tokens, args.rounds,
              ints["swap_tokens"])
    time.sleep(1.0)  # the state is published at least every 0.5 s
    result = compare(args.profile, learned_state(args.server))
    result["serve"] = {"server": args.server, "model": model, "drive": None if args.no_drive else {
        **ints, "decode_tokens": args.decode_tokens, "rounds": args.rounds},
        "seconds": round(time.time() - started, 1), "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, row in result["terms"].items():
        print(f"{name:28s} calibrate {row['calibrate']:.4g}  learned {row['learned']:.4g}")
    swap = result["swap_tokens_per_s"]
    print(f"{'swap_tokens_per_s':28s} calibrate {swap['calibrate']:.4g}  learned {swap['learned']:.4g}")
    fit = result["on_calibrate_medians"]
    print(f"on calibrate's {len(fit['samples'])} medians: relative RMS calibrate {fit['calibrate_relative_rms']:.1%}, "
          f"learned {fit['learned_relative_rms']:.1%}")


if __name__ == "__main__":
    main()
