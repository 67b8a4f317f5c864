#!/bin/sh
# Session arrivals on the simulated cluster (docs/simulator.md, "Session arrivals"): 16 replicas
# of llama3-8b-h100 with the prefix cache, policy mars on each, the claude-code conversations
# with tokens x 0.14, measured over 600 s after 1800 s, seed 0; one file per routing rule.
# First at 1.0 and 1.5 conversations started per second; then, for two rules, with 24 times the
# device KV blocks (kv24-*.json) at 1.0 and 3.0. Give routing rules as arguments to run only those.
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
for routing in ${*:-round-robin least-loaded session-affine mars mars-affine}; do
  marsched compare --arrivals sessions --warmup 1800 --duration 600 --trace claude-code \
    --profile llama3-8b-h100 --token-scale 0.14 --policies mars --qps 1.0,1.5 --seed 0 \
    --replicas 16 --routing "$routing" --json "results/cluster-sessions/$routing.json" --workers 1
done
for routing in ${*:-least-loaded mars-affine}; do
  marsched compare --arrivals sessions --warmup 1800 --duration 600 --trace claude-code \
    --profile llama3-8b-h100 --token-scale 0.14 --policies mars --qps 1.0,3.0 --seed 0 \
    --replicas 16 --routing "$routing" --kv-scale 24 --json "results/cluster-sessions/kv24-$routing.json" --workers 1
done
