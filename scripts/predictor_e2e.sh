#!/usr/bin/env bash
# MARS with the learned length predictor against the oracle, noisy:0.3 and the type-mean rule
# (and INFERCEPT for reference) on the single- and multi-API traces, at the loads where the
# policies differ. Writes results/predictor/e2e-*.json; scripts/predictor_tables.py prints the
# README's table. DURATION (seconds of arrivals, default 300) and M (the marsched command) may be set.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/predictor
mkdir -p "$out"
m=${M:-.venv/bin/marsched}
duration=${DURATION:-300}
declare -A loads=([single]=5,6,8 [multi]=2,2.5,3)
for trace in single multi; do
  qps=${loads[$trace]}
  $m compare --no-prefix-cache --trace "$trace" --policies infercept --qps "$qps" --duration "$duration" \
    --json "$out/e2e-$trace-infercept.json" >/dev/null
  for predictor in oracle noisy:0.3 type-mean learned; do
    $m compare --no-prefix-cache --trace "$trace" --policies mars --predictor "$predictor" --qps "$qps" --duration "$duration" \
      --json "$out/e2e-$trace-mars-${predictor/:/}.json" >/dev/null
  done
  echo "$trace done"
done
