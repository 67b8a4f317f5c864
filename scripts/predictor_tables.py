"""Print the README's end-to-end table of the learned predictor from results/predictor/e2e-*.json."""

from __future__ import annotations

from pathlib import Path

from marsched.experiments.predictor_tables import print_tables

OUT = Path(__file__).resolve().parent.parent / "results" / "predictor"

if __name__ == "__main__":
    print_tables(OUT)
