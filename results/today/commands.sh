#!/bin/sh
# MARS against today's baselines (docs/results.md, "Against today's baselines"): every policy on
# the engine with vLLM V1's prefix cache (the default; vllm-v0 is vLLM 0.2 for reference), 600 s
# of Poisson arrivals, seed 0, from light load to past saturation.
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
P=vllm,vllm-v0,vllm-offload,infercept,continuum,continuum-public,autellix,mars
marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 --policies $P \
  --qps 0.25,0.5,1,2,4 --duration 600 --seed 0 --json results/today/claude-code-llama3-8b-h100.json
marsched compare --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 --policies $P \
  --qps 0.125,0.25,0.5,1,2 --duration 600 --seed 0 --json results/today/claude-code-llama3-70b-4xh100.json
marsched compare --trace multi --profile gptj-6b-a100 --policies $P --qps 3,4,5,6 --duration 600 --seed 0 \
  --json results/today/multi-gptj-6b-a100.json
marsched compare --trace single --profile gptj-6b-a100 --policies $P --qps 3,4,5,6 --duration 600 --seed 0 \
  --json results/today/single-gptj-6b-a100.json
marsched compare --trace agent --profile gptj-6b-a100 --policies $P --qps 0.1,0.2,0.4 --duration 600 --seed 0 \
  --json results/today/agent-gptj-6b-a100.json
# The bundled traces on the H100 profiles (tokens × 1), loads found the same way: light to past saturation.
marsched compare --trace multi --profile llama3-8b-h100 --policies $P --qps 8,16,32,48 --duration 600 --seed 0 \
  --json results/today/multi-llama3-8b-h100.json
marsched compare --trace multi --profile llama3-70b-4xh100 --policies $P --qps 4,8,16,24 --duration 600 --seed 0 \
  --json results/today/multi-llama3-70b-4xh100.json
marsched compare --trace single --profile llama3-8b-h100 --policies $P --qps 16,32,48,64 --duration 600 --seed 0 \
  --json results/today/single-llama3-8b-h100.json
marsched compare --trace single --profile llama3-70b-4xh100 --policies $P --qps 8,16,24,32 --duration 600 --seed 0 \
  --json results/today/single-llama3-70b-4xh100.json
marsched compare --trace agent --profile llama3-8b-h100 --policies $P --qps 0.4,1.6,3.2,6.4 --duration 600 --seed 0 \
  --json results/today/agent-llama3-8b-h100.json
marsched compare --trace agent --profile llama3-70b-4xh100 --policies $P --qps 0.2,0.8,1.6,2.4 --duration 600 --seed 0 \
  --json results/today/agent-llama3-70b-4xh100.json
# MARS with noisy length predictions (each off by a lognormal factor, sigma 0.6; a bound, as they start
# from the true length), same loads; the rest of each request and its call times as the knowable default.
N="--policies mars --predictor noisy:0.6 --duration 600 --seed 0"
marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 $N --qps 0.25,0.5,1,2,4 \
  --json results/today/noisy/claude-code-llama3-8b-h100.json
marsched compare --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 $N --qps 0.125,0.25,0.5,1,2 \
  --json results/today/noisy/claude-code-llama3-70b-4xh100.json
marsched compare --trace multi --profile gptj-6b-a100 $N --qps 3,4,5,6 --json results/today/noisy/multi-gptj-6b-a100.json
marsched compare --trace single --profile gptj-6b-a100 $N --qps 3,4,5,6 --json results/today/noisy/single-gptj-6b-a100.json
marsched compare --trace agent --profile gptj-6b-a100 $N --qps 0.1,0.2,0.4 --json results/today/noisy/agent-gptj-6b-a100.json
marsched compare --trace multi --profile llama3-8b-h100 $N --qps 8,16,32,48 --json results/today/noisy/multi-llama3-8b-h100.json
marsched compare --trace multi --profile llama3-70b-4xh100 $N --qps 4,8,16,24 --json results/today/noisy/multi-llama3-70b-4xh100.json
marsched compare --trace single --profile llama3-8b-h100 $N --qps 16,32,48,64 --json results/today/noisy/single-llama3-8b-h100.json
marsched compare --trace single --profile llama3-70b-4xh100 $N --qps 8,16,24,32 --json results/today/noisy/single-llama3-70b-4xh100.json
marsched compare --trace agent --profile llama3-8b-h100 $N --qps 0.4,1.6,3.2,6.4 --json results/today/noisy/agent-llama3-8b-h100.json
marsched compare --trace agent --profile llama3-70b-4xh100 $N --qps 0.2,0.8,1.6,2.4 --json results/today/noisy/agent-llama3-70b-4xh100.json
# MARS told the future (a bound: every length, call and later segment read from the trace), same loads.
B="--policies mars --predictor foreknowledge --duration 600 --seed 0"
marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 $B --qps 0.25,0.5,1,2,4 \
  --json results/today/bound/claude-code-llama3-8b-h100.json
marsched compare --trace claude-code --profile llama3-70b-4xh100 --token-scale 0.14 $B --qps 0.125,0.25,0.5,1,2 \
  --json results/today/bound/claude-code-llama3-70b-4xh100.json
marsched compare --trace multi --profile gptj-6b-a100 $B --qps 3,4,5,6 --json results/today/bound/multi-gptj-6b-a100.json
marsched compare --trace single --profile gptj-6b-a100 $B --qps 3,4,5,6 --json results/today/bound/single-gptj-6b-a100.json
marsched compare --trace agent --profile gptj-6b-a100 $B --qps 0.1,0.2,0.4 --json results/today/bound/agent-gptj-6b-a100.json
marsched compare --trace multi --profile llama3-8b-h100 $B --qps 8,16,32,48 --json results/today/bound/multi-llama3-8b-h100.json
marsched compare --trace multi --profile llama3-70b-4xh100 $B --qps 4,8,16,24 --json results/today/bound/multi-llama3-70b-4xh100.json
marsched compare --trace single --profile llama3-8b-h100 $B --qps 16,32,48,64 --json results/today/bound/single-llama3-8b-h100.json
marsched compare --trace single --profile llama3-70b-4xh100 $B --qps 8,16,24,32 --json results/today/bound/single-llama3-70b-4xh100.json
marsched compare --trace agent --profile llama3-8b-h100 $B --qps 0.4,1.6,3.2,6.4 --json results/today/bound/agent-llama3-8b-h100.json
marsched compare --trace agent --profile llama3-70b-4xh100 $B --qps 0.2,0.8,1.6,2.4 --json results/today/bound/agent-llama3-70b-4xh100.json
# MARS's starvation settings and orders (docs/results.md, "The trade-off"): every row on every set, in
# the batches it ran in (`today_frontier run` alone runs them all), then the table and
# results/today/frontier/frontier.png.
F="python -m marsched.experiments.today_frontier run"
$F claude-code-llama3-8b-h100 claude-code-llama3-70b-4xh100 multi-gptj-6b-a100 single-gptj-6b-a100 \
  agent-gptj-6b-a100 agent-llama3-8b-h100 agent-llama3-70b-4xh100
$F multi-llama3-8b-h100 fcfs0.8 fcfs1
$F multi-llama3-8b-h100 multi-llama3-70b-4xh100 single-llama3-8b-h100 single-llama3-70b-4xh100 \
  boost0.003 boost0.01 boost0.03 boost-label nudge1 nudge3
$F multi-llama3-8b-h100 multi-llama3-70b-4xh100 single-llama3-8b-h100 single-llama3-70b-4xh100 \
  fcfs1.5 fcfs4 age15 age60 off
$F multi-llama3-70b-4xh100 single-llama3-8b-h100 single-llama3-70b-4xh100 fcfs0.8 fcfs1
python -m marsched.experiments.today_frontier
# What gives MARS its gain (docs/ablation.md, last section): the runs at each set's most loaded
# point, then the table.
python -m marsched.experiments.today_ablation run
python -m marsched.experiments.today_ablation
