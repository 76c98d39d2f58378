#!/usr/bin/env bash
# Installs the third-party data sets kvlab's experiments, tests and docs read into data/ (git
# ignored), each file's sha256 checked. None of them is in the repository: each comes from its
# original public source, or from a copy of it in ../shared/data (these machines and CI, which
# reach no such host; KVLAB_SHARED_DATA names another folder).
#   scripts/get_data.sh NAME...   NAME: azure | mooncake | wikitext2 | prompts | grounded | all
#   scripts/get_data.sh --list    the sets, their files, sizes, licences and sources
# Attribution and licences: docs/data.md. Exit 1 with the reason when a set cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
shared="${KVLAB_SHARED_DATA:-../shared/data}"

# One line a file: set folder file bytes sha256 url [zip-member]. The licence files are checked
# like the data.
FILES="
azure azure-llm-inference-2023 AzureLLMInferenceTrace_conv.csv 719188 2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8 https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_conv.csv
azure azure-llm-inference-2023 AzureLLMInferenceTrace_code.csv 320117 54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6 https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_code.csv
azure azure-llm-inference-2023 LICENSE 18653 9bbc1ea9fe5c96df01b311a2ac864d5b18fc87b9948bfd14770e4b44db755ee9 https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/LICENSE
mooncake mooncake-fast25 conversation_trace.jsonl 3029533 b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl
mooncake mooncake-fast25 synthetic_trace.jsonl 1136313 bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131 https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/synthetic_trace.jsonl
mooncake mooncake-fast25 LICENSE 11357 58d1e17ffe5109a7ae296caafcadfdbe6a7d176f0bc4ab01e12a689b0499d8bd https://www.apache.org/licenses/LICENSE-2.0.txt
wikitext2 wikitext-2-raw wiki.test.raw 1290547 4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c https://huggingface.co/datasets/ggml-org/ci/resolve/main/wikitext-2-raw-v1.zip wikitext-2-raw/wiki.test.raw
prompts prompts mt_bench_questions.jsonl 48929 119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7 https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl
prompts prompts vicuna_bench_questions.jsonl 13125 c248c5c98ba45bb0c2aadae2f270e643bd32679c6c306a3b2a503ac4254cdaa5 https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/vicuna_bench/question.jsonl
prompts prompts gsm8k_test.jsonl 749738 3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14 https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl
prompts prompts LICENSE-gsm8k-MIT 1062 86bbb73e855821d7c401912fd4bf82e34313e6e3b6fd6f909f2b6cc9e209a53b https://raw.githubusercontent.com/openai/grade-school-math/master/LICENSE
"
# Derived: made here from an installed set by the script that defines it, its output checked.
GROUNDED_SHA256=e35c5cce5813123b971cbd10178fd6e9d954eccb8e4b98b844c6f7a140f3963d
SETS="azure mooncake wikitext2 prompts grounded"

licence_of() {
  case "$1" in
    azure) echo "CC BY 4.0; Patel et al., Splitwise, ISCA 2024 (Azure/AzurePublicDataset)" ;;
    mooncake) echo "Apache-2.0; Qin et al., Mooncake, FAST 2025 (kvcache-ai/Mooncake)" ;;
    wikitext2) echo "CC BY-SA 3.0 and GFDL; Merity et al., Pointer Sentinel Mixture Models, 2016" ;;
    prompts) echo "MT-Bench and Vicuna bench: Apache-2.0 (lm-sys/FastChat); GSM8K: MIT (openai/grade-school-math)" ;;
    grounded) echo "CC BY-SA 3.0 (made from WikiText-2 by scripts/make_grounded_prompts.py)" ;;
  esac
}

list() {
  for set in $SETS; do
    echo "$set: $(licence_of "$set")"
    if [ "$set" = grounded ]; then
      echo "  data/prompts/grounded_edits.jsonl  39866 bytes  sha256 $GROUNDED_SHA256  <- wikitext2"
      continue
    fi
    echo "$FILES" | while read -r s folder file bytes sha url member; do
      [ "$s" = "$set" ] && echo "  data/$folder/$file  $bytes bytes  sha256 $sha  <- $url${member:+ ($member)}"
    done
  done
}

fail() {
  echo "get_data.sh: $*" >&2
  exit 1
}

matches() {  # FILE SHA256
  [ -f "$1" ] && echo "$2  $1" | sha256sum -c --status
}

# Downloads URL (a zip's MEMBER when given) to OUT with python3's urllib (no curl needed).
download() {
  python3 - "$1" "$2" "${3:-}" <<'PY' || return 1
import io, sys, urllib.request, zipfile
url, out, member = sys.argv[1:4]
try:
    with urllib.request.urlopen(url, timeout=60) as reply:
        body = reply.read()
    if member:
        body = zipfile.ZipFile(io.BytesIO(body)).read(member)
except Exception as error:  # the reason on one line; the caller says what failed
    print(f"get_data.sh: {url}: {error}", file=sys.stderr)
    sys.exit(1)
with open(out, "wb") as f:
    f.write(body)
PY
}

install_file() {  # folder file bytes sha url member
  local folder="$1" file="$2" sha="$4" url="$5" member="${6:-}"
  local target="data/$folder/$file"
  matches "$target" "$sha" && return 0
  mkdir -p "data/$folder"
  local partial="$target.partial.$$" from
  if [ -f "$shared/$folder/$file" ]; then
    cp "$shared/$folder/$file" "$partial"
    from="$shared/$folder/$file"
  else
    download "$url" "$partial" "$member" || {
      rm -f "$partial"
      fail "cannot download $url (no network, and no copy at $shared/$folder/$file)"
    }
    from="$url"
  fi
  matches "$partial" "$sha" || {
    rm -f "$partial"
    fail "$from does not have the expected sha256 $sha"
  }
  mv "$partial" "$target"
  echo "get_data.sh: $target <- $from"
}

install_set() {
  local set="$1"
  if [ "$set" = grounded ]; then
    install_set wikitext2
    matches data/prompts/grounded_edits.jsonl "$GROUNDED_SHA256" && return 0
    mkdir -p data/prompts
    python3 scripts/make_grounded_prompts.py >/dev/null
    matches data/prompts/grounded_edits.jsonl "$GROUNDED_SHA256" ||
      fail "scripts/make_grounded_prompts.py did not make the expected grounded_edits.jsonl"
    echo "get_data.sh: data/prompts/grounded_edits.jsonl <- scripts/make_grounded_prompts.py"
    return 0
  fi
  local found=0
  while read -r s folder file bytes sha url member; do
    [ "$s" = "$set" ] || continue
    found=1
    install_file "$folder" "$file" "$bytes" "$sha" "$url" "$member"
  done <<<"$FILES"
  [ "$found" = 1 ] || fail "unknown data set \"$set\" (known: $SETS, all)"
}

[ $# -gt 0 ] || { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
for name in "$@"; do
  case "$name" in
    --list) list ;;
    all) for set in $SETS; do install_set "$set"; done ;;
    *) install_set "$name" ;;
  esac
done
