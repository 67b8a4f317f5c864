#!/bin/sh
# The claude-code sweeps of docs/results.md ("Today's agent workload"): 600 s of Poisson
# arrivals, seed 0, tokens x 0.14 (every task then fits Llama-3.1's 131,072-token context).
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
marsched compare --no-prefix-cache --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 \
  --policies vllm,infercept,mars --qps 0.25,0.5,1,2,4 --duration 600 --seed 0 \
  --json results/claude-code/llama3-8b-h100.json --workers 1
marsched compare --no-prefix-cache --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 \
  --policies vllm,infercept,mars --qps 0.125,0.25,0.5,1,2 --duration 600 --seed 0 \
  --json results/claude-code/llama3-70b-4xh100.json --workers 1
# The bound: MARS told every length, call and later segment (not MARS; shown beside it).
marsched compare --no-prefix-cache --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 \
  --policies mars --predictor foreknowledge --qps 0.25,0.5,1,2,4 --duration 600 --seed 0 \
  --json results/claude-code/bound-llama3-8b-h100.json --workers 1
marsched compare --no-prefix-cache --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 \
  --policies mars --predictor foreknowledge --qps 0.125,0.25,0.5,1,2 --duration 600 --seed 0 \
  --json results/claude-code/bound-llama3-70b-4xh100.json --workers 1
