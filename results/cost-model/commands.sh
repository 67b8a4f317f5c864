#!/bin/bash
# What `marsched serve` learns of its cost model beside `marsched calibrate`, on one machine (docs/profiles.md,
# "What serve learns by itself"). Run from the repository root; the same engine settings for both:
# the tests' tiny model, float32, enforce-eager, block size 128, prefix caching off, token budget 2,048.
set -euo pipefail
.venv/bin/python tests/tiny_model.py /tmp/lc/tiny

# 1. calibrate (a short plan). One reserved core, as `marsched serve` keeps it: the model computes on one core in
#    both (without it vLLM reserves a core more for the KV connector and, on two cores, computes on both).
VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/marsched calibrate --model /tmp/lc/tiny --out results/cost-model/calibrated-tiny.json --dtype float32 \
  --kv-cache-gb 0.25 --prefill-tokens 32,128,512,1024 --decode-batches 1,4,16 --decode-contexts 64,512 \
  --decode-steps 8 --repeats 3 --swap-blocks 1,4,16 --force

# 2. serve with no profile and no cost constants: it learns
.venv/bin/marsched serve /tmp/lc/tiny --port 8391 --cpu-kv-cache-gib 1 --predictor oracle -- --dtype float32 --enforce-eager \
  --block-size 128 --no-enable-prefix-caching --max-num-batched-tokens 2048 > /tmp/lc/serve.log 2>&1 &
SERVE=$!
until grep -q "listening on" /tmp/lc/serve.log; do sleep 2; done

# 3. calibrate's kinds of steps sent to the server (and a conversation turn kept as Swap, for the link),
#    then the learned constants beside the calibrated ones, and both against calibrate's measured medians
.venv/bin/python scripts/cost_model_compare.py --server http://127.0.0.1:8391 \
  --profile results/cost-model/calibrated-tiny.json --out results/cost-model/comparison.json

kill -INT $SERVE; wait $SERVE
