#!/bin/sh
# mars-boost's gamma swept on the sets and loads of results/knowable/ (seed 0), whose runs hold
# the other policies (docs/results.md, "Bounded overtaking").
set -e
cd "$(dirname "$0")/../.."  # the repository root, from wherever it is run
PATH="$PWD/.venv/bin:$PATH"  # the marsched and python scripts/setup.sh installed
O=results/boost
for g in 0.001 0.003 0.01 0.03; do
  marsched compare --no-prefix-cache --trace single --policies mars-boost --boost-gamma $g --qps 3,4,5,6 --json $O/single-s0-g$g.json
  marsched compare --no-prefix-cache --trace multi --policies mars-boost --boost-gamma $g --qps 4,6,8,10 --json $O/multi-s0-g$g.json
  marsched compare --no-prefix-cache --trace agent --policies mars-boost --boost-gamma $g --qps 0.1,0.25,0.5 --json $O/agent-s0-g$g.json
  marsched compare --trace claude-code --profile llama3-8b-h100 --token-scale 0.14 --policies mars-boost --boost-gamma $g \
    --qps 0.25,1,4 --json $O/claude-code-8b-g$g.json
done
