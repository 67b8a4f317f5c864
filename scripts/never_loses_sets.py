"""Print a run set of scripts/never_loses.sh as bash assignments (`never_loses_sets.py SET`): the
shell reads its profile, results folder, loads, most loaded points, seeds and frontier variants
from here. The sets are in marsched.experiments.never_loses_sets (never_loses_tables.py reads them too)."""

from __future__ import annotations

import sys

from marsched.experiments.never_loses_sets import RUN_SETS, shell

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in RUN_SETS:
        sys.exit(f"usage: never_loses_sets.py {'|'.join(RUN_SETS)}")
    print(shell(sys.argv[1]), end="")
