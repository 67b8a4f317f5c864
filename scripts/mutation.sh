#!/usr/bin/env bash
# Mutation testing of the policy core and the simulator (src/marsched/policy, src/marsched/sim)
# with mutmut 3.8.1; the configuration is [tool.mutmut] in pyproject.toml.
#
#   scripts/mutation.sh                              every mutant of policy/ and sim/
#   scripts/mutation.sh 'marsched.policy.waste.*'    only the mutants whose names match (globs)
#   scripts/mutation.sh --keep ...                   reuse ./mutants and its results from a last run
#
# mutmut copies src/ and tests/ into ./mutants (git-ignored) and mutates the copy: src/ is never
# touched. It runs each mutant against only the tests that reach the mutated function, from the
# fast subset in [tool.mutmut] (no vLLM, no CLI subprocess tests). Workers: MUTMUT_MAX_CHILDREN
# (default: 2). Install the tool with `.venv/bin/pip install -e '.[mutation]'`.
#
# At the end it prints each surviving mutant and the kill ratio of the mutants it ran, and writes
# mutants/mutation-summary.json. It exits non-zero when mutmut fails (for example when the
# unmutated tests fail), not when mutants survive.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MUTMUT=${MUTMUT:-$(dirname "$PYTHON")/mutmut}

keep=0
if [[ ${1:-} == --keep ]]; then
    keep=1
    shift
fi

if ! version=$("$MUTMUT" --version 2>/dev/null); then
    echo "mutation.sh: mutmut not found at $MUTMUT; install it with: .venv/bin/pip install -e '.[mutation]'" >&2
    exit 2
fi
if [[ $version != *" 3.8.1" ]]; then
    echo "mutation.sh: needs mutmut 3.8.1 (pyproject.toml's 'mutation' extra), found: $version" >&2
    exit 2
fi

if [[ $keep == 0 ]]; then
    rm -rf mutants
fi

started=$(date +%s)
status=0
"$MUTMUT" run --max-children "${MUTMUT_MAX_CHILDREN:-2}" "$@" || status=$?
elapsed=$(($(date +%s) - started))
if [[ $status != 0 ]]; then
    echo "mutation.sh: mutmut run failed (exit $status) after ${elapsed}s" >&2
    exit "$status"
fi

"$MUTMUT" export-cicd-stats

# The kill ratio of the mutants this run was asked for (all of them when no glob was given).
"$PYTHON" - "$elapsed" "$@" <<'EOF'
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

elapsed, patterns = float(sys.argv[1]), sys.argv[2:]
# mutmut's exit codes (mutmut/stats.py).
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", -11: "segfault", -9: "segfault", 2: "interrupted", None: "not checked"}
statuses: dict[str, str] = {}
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if not patterns or any(fnmatch.fnmatch(name, p) for p in patterns):
            statuses[name] = STATUS.get(code, "suspicious")
if not statuses:
    sys.exit("mutation.sh: no mutant results under mutants/")
counts = Counter(statuses.values())
for name, status in sorted(statuses.items()):
    if status not in ("killed", "timeout", "caught by type check"):
        print(f"  {status}: {name}")
detected = counts["killed"] + counts["timeout"] + counts["caught by type check"]
checked = sum(n for s, n in counts.items() if s not in ("not checked", "skipped", "interrupted"))
ratio = detected / checked if checked else 0.0
summary = {"mutants": len(statuses), "checked": checked, "detected": detected, "kill_ratio": round(ratio, 4),
           "elapsed_s": elapsed, "seconds_per_mutant": round(elapsed / max(checked, 1), 3),
           "by_status": dict(sorted(counts.items()))}
Path("mutants/mutation-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
print(f"kill ratio: {detected}/{checked} = {ratio:.1%} (killed, timed out or caught; of {len(statuses)} mutants) "
      f"in {elapsed:.0f}s, {summary['seconds_per_mutant']}s per mutant")
if counts["not checked"] or counts["interrupted"]:
    sys.exit("mutation.sh: some mutants were not checked")
EOF
