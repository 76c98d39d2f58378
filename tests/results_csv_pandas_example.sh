#!/usr/bin/env bash
# The pandas example of docs/experiments.md ("For a notebook") on a real results folder: runs
# experiments/azure_conv_replay.toml (simulated, ~10 s), then the page's ```python block as shown,
# from the folder that holds results/; the pivot must have a row per rate scale and a column
# per scheduler. Usage: tests/results_csv_pandas_example.sh KVLAB SOURCE_DIR PYTHON
set -euo pipefail
kvlab=$1 source=$2 python=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$kvlab" run "$source/experiments/azure_conv_replay.toml" --out results/azure_conv_replay >/dev/null
# The python block after the "For a notebook" paragraph.
awk '/^\*\*For a notebook:\*\*/ { found = 1 } found && /^```python/ { on = 1; next }
     on && /^```/ { exit } on { print }' "$source/docs/experiments.md" >example.py
[ -s example.py ] || { echo "no python block after 'For a notebook' in docs/experiments.md"; exit 1; }
"$python" example.py | tee printed.txt
for scheduler in chunked fcfs static; do
  grep -q "$scheduler" printed.txt || { echo "no column for $scheduler"; exit 1; }
done
for scale in 1.0 2.0 4.0 8.0; do
  grep -qE "^$scale " printed.txt || { echo "no row for rate scale $scale"; exit 1; }
done
