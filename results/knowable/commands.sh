#!/bin/sh
# MARS that knows only what a server knows (the default: online lengths, past-mean calls, the
# Gittins rank over the turns left), beside the same MARS told the future (`--predictor
# foreknowledge`, a bound) and the baselines (docs/results.md, "The knowledge boundary").
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
O=results/knowable
# The paper's engines (vLLM 0.2, no prefix cache), GPT-J 6B on an A100; two seeds.
for seed in 0 1; do
  marsched compare --no-prefix-cache --trace single --policies vllm,infercept,mars --qps 3,4,5,6 --seed $seed --json $O/single-s$seed.json
  marsched compare --no-prefix-cache --trace multi --policies vllm,infercept,mars --qps 4,6,8,10 --seed $seed --json $O/multi-s$seed.json
  marsched compare --no-prefix-cache --trace agent --policies vllm,infercept,mars --qps 0.1,0.25,0.5 --seed $seed --json $O/agent-s$seed.json
  marsched compare --no-prefix-cache --trace single --policies mars --predictor foreknowledge --qps 3,4,5,6 --seed $seed --json $O/single-s$seed-bound.json
  marsched compare --no-prefix-cache --trace multi --policies mars --predictor foreknowledge --qps 4,6,8,10 --seed $seed --json $O/multi-s$seed-bound.json
  marsched compare --no-prefix-cache --trace agent --policies mars --predictor foreknowledge --qps 0.1,0.25,0.5 --seed $seed --json $O/agent-s$seed-bound.json
done
# Today's agent workload against today's baselines (vLLM V1 with its prefix cache), seed 0.
P=vllm,vllm-offload,infercept,continuum,autellix,mars
marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 --policies $P --qps 0.25,1,4 --seed 0 \
  --json $O/claude-code-8b.json
marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 --policies mars --predictor foreknowledge \
  --qps 0.25,1,4 --seed 0 --json $O/claude-code-8b-bound.json
marsched compare --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 --policies $P --qps 0.125,0.5,2 --seed 0 \
  --json $O/claude-code-70b.json
marsched compare --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 --policies mars --predictor foreknowledge \
  --qps 0.125,0.5,2 --seed 0 --json $O/claude-code-70b-bound.json
