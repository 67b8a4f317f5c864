#!/usr/bin/env bash
# Where MARS wins: MARS over INFERCEPT mean and p99 end-to-end latency over load × KV capacity ×
# API time on the three bundled traces. Writes results/regime/{single,multi,agent}.{json,png}.
# Coarse on purpose (5 loads × 3 KV scales × 3 API-time scales, 300 s of arrivals, one process):
# about 6 minutes of CPU time (single 2, multi 3.5, agent 0.5), 20 minutes of wall time on two
# busy shared cores. Re-run with another profile: PROFILE=my.json scripts/regime_maps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/regime}
profile=${PROFILE:-gptj-6b-a100}
duration=${DURATION:-300}
mkdir -p "$out"
m=${MARSCHED:-.venv/bin/marsched}
# Loads from light to past INFERCEPT's knee at ×1, as in the never-loses tables.
declare -A loads=([single]=2,4,5,6,8 [multi]=0.5,1,1.5,2,3 [agent]=0.05,0.1,0.15,0.2,0.3)
for trace in single multi agent; do
  $m regime --trace "$trace" --qps "${loads[$trace]}" --kv-scale 0.5,1,2 --api-time-scale 0.5,1,2 \
    --profile "$profile" --duration "$duration" --seed 0 --workers 1 \
    --json "$out/$trace.json" --plot "$out/$trace.png"
done
