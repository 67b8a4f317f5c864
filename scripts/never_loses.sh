#!/usr/bin/env bash
# MARS against INFERCEPT and stock vLLM on the three bundled traces, light load to past
# saturation, with the starvation/admission ablation and noisy predictions. Writes
# results/never-loses/*.json; scripts/never_loses_tables.py turns them into the README's tables.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/never-loses
mkdir -p "$out"
m=.venv/bin/marsched
declare -A loads=([single]=3,4,5,6,8,10,12,14,16 [multi]=0.5,1,1.5,2,2.5,3 [agent]=0.05,0.1,0.15,0.2,0.3,0.4)
for trace in single multi agent; do
  qps=${loads[$trace]}
  $m compare --trace "$trace" --policies vllm,infercept,mars --qps "$qps" --json "$out/$trace-main.json" \
    --plot "$out/$trace-main.png" >/dev/null
  for sigma in 0.3 0.6; do
    $m compare --trace "$trace" --policies mars --predictor "noisy:$sigma" --qps "$qps" --json "$out/$trace-noisy$sigma.json" >/dev/null
  done
  for variant in published iterations off; do
    $m compare --trace "$trace" --policies mars --starvation "$variant" --qps "$qps" --json "$out/$trace-$variant.json" >/dev/null
  done
  for variant in age published iterations off; do
    $m compare --trace "$trace" --policies mars --starvation "$variant" --admission greedy --qps "$qps" \
      --json "$out/$trace-$variant-greedy.json" >/dev/null
  done
  echo "$trace done"
done
# The age threshold at the most loaded point of each trace.
declare -A top=([single]=16 [multi]=3 [agent]=0.4)
for trace in single multi agent; do
  for threshold in 5 30 60 120 240; do
    $m compare --trace "$trace" --policies mars --starvation-threshold "$threshold" --qps "${top[$trace]}" \
      --json "$out/$trace-age$threshold.json" >/dev/null
  done
done
