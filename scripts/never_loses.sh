#!/usr/bin/env bash
# MARS against INFERCEPT (the paper's rule, and its published code: infercept-code) and stock vLLM
# on the three bundled traces, light load to past saturation, with the starvation/admission
# ablation and noisy predictions. Writes
# results/never-loses/*.json; scripts/never_loses_tables.py turns them into the README's tables.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/never-loses
mkdir -p "$out"
m=${MARSCHED:-.venv/bin/marsched}  # the command to run (word-split: it may carry a prefix)
declare -A loads=([single]=3,4,5,6,8,10,12,14,16 [multi]=0.5,1,1.5,2,2.5,3,4,5 [agent]=0.05,0.1,0.15,0.2,0.3,0.4)
for trace in single multi agent; do
  qps=${loads[$trace]}
  $m compare --trace "$trace" --policies vllm,infercept,mars --qps "$qps" --json "$out/$trace-main.json" \
    --plot "$out/$trace-main.png" >/dev/null
  $m compare --trace "$trace" --policies infercept-code --qps "$qps" --json "$out/$trace-infercept-code.json" >/dev/null
  for sigma in 0.3 0.6; do
    $m compare --trace "$trace" --policies mars --predictor "noisy:$sigma" --qps "$qps" --json "$out/$trace-noisy$sigma.json" >/dev/null
  done
  for variant in age published iterations off; do
    $m compare --trace "$trace" --policies mars --starvation "$variant" --qps "$qps" --json "$out/$trace-$variant.json" >/dev/null
  done
  for variant in fcfs-wait age published iterations off; do
    $m compare --trace "$trace" --policies mars --starvation "$variant" --admission greedy --qps "$qps" \
      --json "$out/$trace-$variant-greedy.json" >/dev/null
  done
  echo "$trace done"
done
# The trade-off frontier at the most loaded point of each trace: the fcfs-wait multiple, and
# the age threshold (the default's multiple 1.1 and age's 15 s are in the runs above).
declare -A top=([single]=16 [multi]=5 [agent]=0.4)
for trace in single multi agent; do
  for multiple in 0.8 1 1.25 1.5 2 3; do
    $m compare --trace "$trace" --policies mars --starvation "fcfs-wait:$multiple" --qps "${top[$trace]}" \
      --json "$out/$trace-fcfs$multiple.json" >/dev/null
  done
  for threshold in 60 240; do
    $m compare --trace "$trace" --policies mars --starvation age --starvation-threshold "$threshold" --qps "${top[$trace]}" \
      --json "$out/$trace-age$threshold.json" >/dev/null
  done
done
