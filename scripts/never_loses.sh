#!/usr/bin/env bash
# MARS against INFERCEPT (the paper's rule, and its published code: infercept-code) and stock vLLM
# on the three bundled traces, light load to past saturation, with the starvation/admission
# ablation, noisy length predictions and the bound (MARS told the future).
#   scripts/never_loses.sh              the bundled GPT-J profile: results/never-loses/*.json
#   scripts/never_loses.sh calibrated   the profile measured on vLLM (results/calibrated-cpu.json):
#                                       results/never-loses-calibrated/*.json
#   scripts/never_loses.sh SET --seeds  only the sweep over seeds at each trace's most loaded point
#                                       (INFERCEPT, MARS, its bound, MARS without starvation prevention, SJF):
#                                       <the set's folder>/seeds/*.json
# The loads, most loaded points, seeds and frontier variants are in scripts/never_loses_sets.py;
# scripts/never_loses_tables.py [calibrated] turns the results into the README's tables.
set -euo pipefail
cd "$(dirname "$0")/.."
m=${MARSCHED:-.venv/bin/marsched}  # the command to run (word-split: it may carry a prefix)
python=${PYTHON:-.venv/bin/python}
usage() { echo "usage: $0 [gptj|calibrated] [--seeds]" >&2; exit 2; }
set_name=gptj; only_seeds=no
for arg in "$@"; do
  case "$arg" in
    gptj|calibrated) set_name=$arg ;;
    --seeds) only_seeds=yes ;;
    *) usage ;;
  esac
done
sets=$("$python" scripts/never_loses_sets.py "$set_name")  # an assignment, so that set -e stops on failure
eval "$sets"
run() { $m compare --no-prefix-cache --profile "$profile" "$@" >/dev/null; }
if [ "$only_seeds" = yes ]; then
  # Is the most loaded point's ratio a property of the trace or of seed 0? And how low can any
  # order go there: no starvation prevention (off), and shortest predicted output first (sjf).
  mkdir -p "$out/seeds"
  for trace in single multi agent; do
    for seed in "${seeds[@]}"; do
      common=(--trace "$trace" --qps "${top[$trace]}" --seed "$seed")
      run "${common[@]}" --policies infercept,mars --json "$out/seeds/$trace-seed$seed.json"
      run "${common[@]}" --policies mars --predictor foreknowledge --json "$out/seeds/$trace-bound-seed$seed.json"
      # one process each: side by side on two cores
      run "${common[@]}" --policies mars --starvation off --json "$out/seeds/$trace-off-seed$seed.json" & off=$!
      run "${common[@]}" --policies sjf --admission predicted-peak --json "$out/seeds/$trace-sjf-seed$seed.json" & sjf=$!
      wait "$off"; wait "$sjf"
    done
    echo "$trace done"
  done
  exit 0
fi
mkdir -p "$out"
for trace in single multi agent; do
  qps=${loads[$trace]}
  run --trace "$trace" --policies vllm,infercept,mars --qps "$qps" --json "$out/$trace-main.json" --plot "$out/$trace-main.png"
  run --trace "$trace" --policies infercept-code --qps "$qps" --json "$out/$trace-infercept-code.json"
  # MARS told the future: a bound, shown beside MARS, never as it
  run --trace "$trace" --policies mars --predictor foreknowledge --qps "$qps" --json "$out/$trace-bound.json"
  for sigma in 0.3 0.6; do
    run --trace "$trace" --policies mars --predictor "noisy:$sigma" --qps "$qps" --json "$out/$trace-noisy$sigma.json"
  done
  for variant in age published iterations off; do
    run --trace "$trace" --policies mars --starvation "$variant" --qps "$qps" --json "$out/$trace-$variant.json"
  done
  for variant in fcfs-wait age published iterations off; do
    run --trace "$trace" --policies mars --starvation "$variant" --admission greedy --qps "$qps" \
      --json "$out/$trace-$variant-greedy.json"
  done
  echo "$trace done"
done
# The trade-off frontier at the most loaded point of each trace: the fcfs-wait multiple, and
# the age threshold (the default's multiple 2 and age's 15 s are in the runs above).
for trace in single multi agent; do
  for multiple in "${multiples[@]}"; do
    run --trace "$trace" --policies mars --starvation "fcfs-wait:$multiple" --qps "${top[$trace]}" \
      --json "$out/$trace-fcfs$multiple.json"
  done
  for threshold in "${ages[@]}"; do
    run --trace "$trace" --policies mars --starvation age --starvation-threshold "$threshold" --qps "${top[$trace]}" \
      --json "$out/$trace-age$threshold.json"
  done
done
