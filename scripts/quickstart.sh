#!/usr/bin/env bash
# The README's first command: set up, build, and run kvlab's main job on the built-in default,
# the quickstart experiment (static vs continuous batching; results in results/quickstart/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir="${KVLAB_BUILD_DIR:-build}"
"$build_dir/bin/kvlab" run experiments/quickstart.toml --force  # a rerun replaces results/quickstart
