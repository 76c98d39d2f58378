#!/usr/bin/env bash
# The README's first command: set up, build, and run kvlab's main job on the built-in default.
# (Until the experiment runner lands, the main job is `kvlab generate` on the stories15m preset:
# random weights, greedy, full-recompute CPU reference.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir="${KVLAB_BUILD_DIR:-build}"
"$build_dir/bin/kvlab" generate --preset stories15m --prompt-ids 1,450,4996,17354 --max-tokens 32 --logprobs 3
"$build_dir/bin/kvlab" memory --model llama-7b --seq-len 2048 --batch 1 --dtype f16 --gpu-mem 80
