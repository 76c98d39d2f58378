#!/usr/bin/env bash
# scripts/get_data.sh in a scratch copy of the scripts (it installs beside itself, into data/):
# a set installs from the shared copy with its sha256 checked, a second call changes nothing, a
# corrupted copy is refused with nothing installed, an unknown name is an error, and the derived
# grounded prompts are made byte for byte. Skips (77) without ../shared/data.
set -euo pipefail
source_dir="$1"
shared="${KVLAB_SHARED_DATA:-$source_dir/../shared/data}"
[ -d "$shared/azure-llm-inference-2023" ] || { echo "skip: no shared data at $shared"; exit 77; }
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/scripts"
cp "$source_dir/scripts/get_data.sh" "$source_dir/scripts/make_grounded_prompts.py" "$scratch/scripts/"
get() { KVLAB_SHARED_DATA="$1" "$scratch/scripts/get_data.sh" "${@:2}"; }
fail() { echo "FAIL: $*"; exit 1; }

get "$shared" azure >"$scratch/out" 2>&1 || fail "azure from $shared: $(cat "$scratch/out")"
[ "$(sha256sum <"$scratch/data/azure-llm-inference-2023/AzureLLMInferenceTrace_conv.csv" | cut -c1-64)" = \
  2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8 ] || fail "azure's conv trace differs"
[ -z "$(get "$shared" azure 2>&1)" ] || fail "a second call did something"

mkdir -p "$scratch/bad/mooncake-fast25"
cp "$shared/mooncake-fast25/"* "$scratch/bad/mooncake-fast25/"
printf '{}\n' >>"$scratch/bad/mooncake-fast25/conversation_trace.jsonl"
if get "$scratch/bad" mooncake >"$scratch/out" 2>&1; then fail "a corrupted copy was taken"; fi
grep -q "does not have the expected sha256" "$scratch/out" || fail "no reason: $(cat "$scratch/out")"
[ ! -e "$scratch/data/mooncake-fast25/conversation_trace.jsonl" ] || fail "the corrupted file was installed"

if get "$shared" nonsense >"$scratch/out" 2>&1; then fail "an unknown set was taken"; fi
grep -q 'unknown data set "nonsense"' "$scratch/out" || fail "no reason: $(cat "$scratch/out")"

get "$shared" grounded >"$scratch/out" 2>&1 || fail "grounded: $(cat "$scratch/out")"
[ -f "$scratch/data/prompts/grounded_edits.jsonl" ] || fail "no grounded_edits.jsonl"
echo "get_data.sh: OK"
