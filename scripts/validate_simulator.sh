#!/bin/sh
# The simulated backend's validation on this machine (docs/concepts/simulated-backend.md):
#   1. kvlab calibrate fits a cpu profile (its shape grid and an engine replay of its own),
#   2. experiments/calibration.toml runs three workloads on the measured cpu backend and on the
#      simulated backend with that profile (3 seeds each),
#   3. experiments/compare_calibration.py prints the predictions' errors.
# Calibration and validation run back to back on purpose: a shared VM's speed drifts by tens of
# percent over minutes, and a profile measured earlier predicts a different machine.
#   scripts/validate_simulator.sh [RESULTS_FOLDER]   (default results/calibration; KVLAB=binary)
set -eu
cd "$(dirname "$0")/.."
kvlab=${KVLAB:-build/bin/kvlab}
out=${1:-results/calibration}
"$kvlab" calibrate --backend cpu --model stories15m --threads 2 --repeats 9 \
  --out results/cpu-profile.toml
"$kvlab" run experiments/calibration.toml --force --out "$out" > "$out.log" 2>&1
python3 experiments/compare_calibration.py "$out"
