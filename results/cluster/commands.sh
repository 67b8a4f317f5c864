#!/bin/sh
# The simulated cluster of docs/simulator.md ("A cluster: replicas behind a router"): 16 replicas
# of llama3-8b-h100, policy mars on each, the claude-code trace with tokens x 0.14, 600 s of
# Poisson arrivals, seed 0, one file per routing rule.
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
for routing in round-robin least-loaded session-affine mars mars-affine; do
  marsched compare --no-prefix-cache --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 --policies mars \
    --qps 16,24,32 --duration 600 --seed 0 --replicas 16 --routing "$routing" \
    --json "results/cluster/$routing.json" --workers 1
done
