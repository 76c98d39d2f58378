#!/bin/sh
# Runs a command that needs Gemma 3 270M (scripts/get_model.sh gemma3), from the source root;
# exit 77 (ctest: skipped, with the reason) when the model could not be fetched.
# Usage: tests/with_gemma3.sh COMMAND [ARGS...]
set -eu
cd "$(dirname "$0")/.."
if [ ! -f models/gemma3/gemma-3-270m-q4_k_m.gguf ]; then
  echo "models/gemma3 is not here: scripts/get_model.sh gemma3 could not fetch it (see models.get_gemma3)"
  exit 77
fi
exec "$@"
