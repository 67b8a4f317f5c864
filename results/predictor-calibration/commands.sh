#!/usr/bin/env bash
# What online calibration buys a learned head on agent text from a family it never trained on
# (docs/predictor.md, "Calibrated online"). Needs the predict extra; about a minute on 2 CPU cores.
# Holds out each agent-text family in turn: trains a head on the other (agent_train, "alone"),
# replays the held-out family's sessions in order, and scores raw, calibrated (learned-online)
# and online predictions, with the heads scaled by 1, 30 and 1/30.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/python -m marsched.experiments.predictor_calibration --out results/predictor-calibration/holdout-family.json
