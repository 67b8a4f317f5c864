#!/usr/bin/env bash
# The HTTP comparison as it is meant to be recorded (docs/bench.md, "HTTP comparison"): stock vLLM
# and marsched serve's policies (vllm, infercept, continuum, mars) replaying the same bounded
# agent-text workload (`marsched loadgen`), on the same model, KV size and cores, at two loads:
#   light  0.1 conversations/s: requests rarely wait;
#   heavy  0.4 conversations/s: requests queue (waiting counts up to ~8 on a 2-core CPU).
# 60 s of arrivals, 3 repeats interleaved, seed 0. Writes results/http/{light,heavy}/: summary.json,
# summary.md, and runs/<config>-r<k>/ (loadgen report, server log, run record).
# Builds the random-weight model with `marsched model` if it is absent (MODEL=dir to use another).
# Extra arguments go to both loads (e.g. --repeats 1, --configs vllm-stock,mars, --duration 30).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}  # PYTHON=... for another environment
model=${MODEL:-/tmp/marsched-http-bench-model}
out=${OUT:-results/http}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -f "$model/config.json" ]; then
    echo "building the random-weight model in $model (marsched model)" >&2
    "$python" -m marsched.cli model --out "$model"
fi
echo "load average $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo ?) on $(nproc) cores" \
     "(the summary keeps it; measure on a quiet machine)" >&2
status=0
for load in "light ${LIGHT_RATE:-0.1}" "heavy ${HEAVY_RATE:-0.4}"; do
    name=${load% *} rate=${load#* }
    code=0
    "$python" -m marsched.experiments.http_bench --model "$model" --rate "$rate" --duration 60 --repeats 3 \
        --out "$out/$name" "$@" || code=$?
    case $code in
        0) ;;
        1) status=1 ;;  # some run did not measure; the other load still runs
        *) exit "$code" ;;  # interrupted (130), cores differ (3), bad flags (2)
    esac
done
exit "$status"
