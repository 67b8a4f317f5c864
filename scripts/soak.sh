#!/usr/bin/env bash
# The soak: the probe's fault mix (32 clients) against stock vLLM, then `marsched serve`, for
# 10 minutes each, then what each server still holds. Writes results/probe/{vllm,mars}.json,
# table.md and the servers' logs. Extra arguments go to `python -m marsched.experiments.probe`
# (e.g. --duration 60 --clients 8 for a short look, --configs mars).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}  # PYTHON=... for another environment
echo "load average $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0) on $(nproc) cores"
exec env PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" "$python" -m marsched.experiments.probe "$@"
