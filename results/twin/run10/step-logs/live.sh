#!/bin/bash
# One live run at the twin's queueing load (10 tasks/s) against stock vLLM with vLLM's scheduler logging
# every step (bench's StepTimedScheduler, MARSCHED_STEP_LOG), in place of the step meter. Run from the
# repository root, with the twin's model at /tmp/twin/model:
#   results/twin/run10/step-logs/live.sh host '{"kv_connector":"HostPrefixTierConnector","kv_role":"kv_both","kv_connector_module_path":"marsched.vllm.prefix_tier","kv_connector_extra_config":{"host_tokens":4194304}}'
#   results/twin/run10/step-logs/live.sh stock
# Then: .venv/bin/python -m marsched.experiments.twin.step_log results/twin/run10/step-logs/host.steps.jsonl \
#           --profile results/twin/run9/profile.json
set -u
name=$1; kv=${2:-}
out=$(dirname "$0")
port=40999
log=$out/$name.steps.jsonl; rm -f "$log"
args=(--model /tmp/twin/model --host 127.0.0.1 --port $port --logits-processors marsched.loadgen.reply_length:BenchReplyLength
  --scheduler-cls marsched.bench.steps.StepTimedScheduler --max-model-len 32768 --num-gpu-blocks-override 257 --seed 0
  --enforce-eager --enable-prefix-caching --disable-uvicorn-access-log --max-num-seqs 64 --max-num-batched-tokens 4096)
[ -n "$kv" ] && args+=(--kv-transfer-config "$kv")
setsid env VLLM_CPU_NUM_OF_RESERVED_CPU=1 MARSCHED_STEP_LOG="$log" .venv/bin/python -m vllm.entrypoints.openai.api_server \
  "${args[@]}" > "$out/$name.server.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/v1/models > /dev/null && break; sleep 1; done
.venv/bin/marsched loadgen http://127.0.0.1:$port --workload claude-code --rate 10 --duration 60 --seed 0 --gap-scale 0.1 \
  --max-gap-s 10 --token-scale 0.03 --max-turns 20 --max-tokens 4096 --conversation-keys --request-timeout 600 \
  > "$out/$name.loadgen.log" 2>&1
kill -TERM -- -$server; sleep 5; kill -KILL -- -$server 2> /dev/null
echo "done: $log"
