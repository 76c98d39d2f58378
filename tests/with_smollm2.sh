#!/bin/sh
# Runs a command that needs SmolLM2 (scripts/get_model.sh smollm2), from the source root;
# exit 77 (ctest: skipped, with the reason) when the model could not be fetched.
# Usage: tests/with_smollm2.sh COMMAND [ARGS...]
set -eu
cd "$(dirname "$0")/.."
if [ ! -f models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "models/smollm2 is not here: scripts/get_model.sh smollm2 could not fetch it (see models.get_smollm2)"
  exit 77
fi
exec "$@"
