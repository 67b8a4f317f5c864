#!/usr/bin/env bash
# The conversation-retention benchmark as it is meant to be recorded: stock vLLM, marsched
# --retention policy and --retention fixed:T, default load, seed 0, on a quiet machine.
# Writes results/conversations/{vllm,mars,fixed}.json, table.md and the servers' logs.
# Extra arguments go to scripts/conversation_bench.py (e.g. --quick, --seed 1, --configs vllm,mars).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}  # PYTHON=... for another environment
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
echo "load average $load on $(nproc) cores (the record keeps it; measure on a quiet machine)"
exec env PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" "$python" scripts/conversation_bench.py "$@"
