#!/usr/bin/env bash
# GPU checks in one command, for a machine with an NVIDIA GPU (an H200 here: within 8 minutes):
#   1. configure + build (Release, sm_90 unless KVLAB_CUDA_ARCHS says otherwise) only what the
#      checks need, with every core
#   2. the CUDA tests: every kernel against the Eigen reference, the engine on the GPU against the
#      CPU backend (ctest -L '^cuda$'; the same tests on the CPU emulator run in CI everywhere)
#   3. the decode-attention and prefill benchmarks (bandwidth and TFLOP/s against the peaks)
#   4. kvlab calibrate --backend cuda: every shape against its roofline (the B=256 decode step
#      among them) and the fitted H200 profile (to commit as profiles/h200-measured.toml)
#   5. end to end: experiments/cuda_fcfs_vs_static.toml (fcfs vs static, 1,024 requests) on the
#      measured clock, each step priced by that profile as it runs; the same workload on the
#      simulated backend with it (the simulator's prediction error); Hugging Face generate() on
#      the same requests (kvlab's output tok/s as a ratio to it)
#   6. kvlab check of the cuda backend in bf16, and in fp32 over fp8 and int8 KV pools, each with
#      its stated tolerance (and its logit error)
#   7. compute-sanitizer memcheck on the kernels and one engine run, racecheck on the kernels
#      that share memory
#   8. a summary of all of it
# Every stage runs under a time limit (what is left of KVLAB_GPU_CHECK_BUDGET_S, default 480 s,
# or its own cap if smaller): a stage that hangs costs its cap, not the run. With $OUT set (the
# device tool's folder), each stage's log and results land there as soon as it ends, and
# summary.txt grows line by line: a run cut short still brings back what it measured.
# Usage: scripts/gpu_check.sh        (build dir: build-gpu, or $KVLAB_BUILD_DIR)
#        scripts/gpu_check.sh --prebuilt   (the build dir is there already: no setup, no build;
#                                           a machine without Debian's packages runs the pack
#                                           scripts/gpu_pack.sh made: bash gpu-pack/run.sh)
#        scripts/gpu_check.sh --targets    (prints the build targets the checks need)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
targets=(kvlab_gpu_check_suite)  # CMakeLists.txt: the programs, tests and plugins run below
if [ "${1:-}" = --targets ]; then echo "${targets[@]}"; exit 0; fi
prebuilt=0
if [ "${1:-}" = --prebuilt ]; then prebuilt=1; elif [ $# -gt 0 ]; then
  echo "usage: scripts/gpu_check.sh [--prebuilt | --targets]" >&2; exit 2
fi
export PATH="/usr/local/cuda/bin:$PATH"
build="${KVLAB_BUILD_DIR:-build-gpu}"
archs="${KVLAB_CUDA_ARCHS:-90}"
budget="${KVLAB_GPU_CHECK_BUDGET_S:-480}"
out="${OUT:-}"
[ -n "$out" ] && [ ! -d "$out" ] && out=""
summary=()
start=$(date +%s)
status=0
note() {
  summary+=("$1"); echo "== $1"
  if [ -n "$out" ]; then echo "$1" >>"$out/summary.txt"; fi
}
keep() {  # files of the build dir (or folders, as .tar.gz) into $OUT
  [ -n "$out" ] || return 0
  local f
  for f in "$@"; do
    if [ -d "$build/$f" ]; then tar -czf "$out/$f.tar.gz" -C "$build" "$f"
    elif [ -f "$build/$f" ]; then cp "$build/$f" "$out/"; fi
  done
}
# stage NAME CAP LOG COMMAND...: runs COMMAND (output to $build/LOG) for at most CAP seconds or
# what is left of the budget; 0 when it passed, 124 when time ran out, its status otherwise.
stage() {
  local name=$1 cap=$2 log=$3 left t0 rc
  shift 3
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 15 ]; then
    note "$name: SKIPPED (the ${budget}-s budget is spent)"; status=1; return 125
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >"$build/$log" 2>&1
  rc=$?
  keep "$log"
  echo "-- $name: status $rc in $(( $(date +%s) - t0 )) s"
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    note "$name: TIMED OUT after $cap s (log: $log)"; status=1; return 124
  fi
  return $rc
}

[ -n "$out" ] && : >"$out/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || note "nvidia-smi: no GPU visible"

if [ $prebuilt = 1 ]; then
  [ -x "$build/bin/kvlab" ] || { note "--prebuilt: no $build/bin/kvlab"; exit 1; }
  note "build: prebuilt ($build)"
else
  KVLAB_SETUP_PACKAGES_ONLY=1 scripts/setup.sh > "/tmp/kvlab_gpu_setup.log" 2>&1 ||
    note "setup: installing packages failed (see /tmp/kvlab_gpu_setup.log); trying to build anyway"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$archs" >/dev/null || { note "configure FAILED"; exit 1; }
  if cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" 2>&1 | tail -3; then
    note "build: ok in $(( $(date +%s) - start )) s (sm_$archs)"
    start=$(date +%s)  # the budget is for the checks
  else
    note "build FAILED"; exit 1
  fi
fi
kvlab="$build/bin/kvlab"

# --- 2. the CUDA tests
if OMP_NUM_THREADS=4 stage "CUDA tests" 150 cuda_ctest.log \
     ctest --test-dir "$build" -L '^cuda$' --no-tests=error --output-on-failure -j 4; then
  note "CUDA tests: $(grep -E 'tests passed' "$build/cuda_ctest.log")"
else
  status=1
  note "CUDA tests FAILED: $(grep -E 'tests passed' "$build/cuda_ctest.log")"
  grep -E "Failed|\*\*\*" "$build/cuda_ctest.log" | head -20
fi

# --- 3. decode attention bandwidth and prefill TFLOP/s
stage "benchmarks" 90 bench_cuda.log "$build/bin/kvlab_bench_cuda" --benchmark_min_time=0.2 \
  --benchmark_out="$build/bench_cuda.json" --benchmark_out_format=json
keep bench_cuda.json
while IFS= read -r line; do note "$line"; done < <(python3 - "$build/bench_cuda.json" <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
except Exception as e:  # no file: the benchmark did not run
    print(f"decode attention benchmark: no results ({e})"); sys.exit()
for r in runs:
    if "error_message" in r:
        print(f"{r['name']}: {r['error_message']}"); continue
    if "TFLOP_per_s" in r:
        print(f"{r['name']}: {r['real_time']:.1f} {r['time_unit']}, {r['TFLOP_per_s']:.1f} "
              f"TFLOP/s (aim >= 300 in bf16)"); continue
    gbs, peak = r["kv_GB_per_s"], r["peak_GB_per_s"]
    source = "driver peak"
    if peak <= 0:  # the driver did not report its memory clock: the H200 datasheet
        peak, source = 4800.0, "H200 datasheet peak"
    print(f"{r['name']}: {r['real_time']:.1f} {r['time_unit']}, K/V read {gbs:.0f} GB/s of "
          f"{peak:.0f} GB/s {source} = {100 * gbs / peak:.1f}% (aim >= 80% in bf16)")
PY
)

# --- 4. calibrate: every shape against its roofline, and the measured profile
# It starts from the kernel terms fitted to Vidur's measured operators (floors, knees, waves:
# kept by the fit), so it measures the efficiencies and overheads beside them, the overhead of
# steps that replay no CUDA graph included: h100-sxm on an H100, h200 (those terms carried onto
# the H200's peaks) on anything else.
profile=h200  # the shipped profile, if the calibration fails
start=h200
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
  *H100*) measured=h100-measured start=h100-sxm ;;
  *) measured=h200-measured ;;
esac
if stage "kvlab calibrate --backend cuda" 90 calibrate.log "$kvlab" calibrate --backend cuda \
     --profile "$start" --model tinyllama-1.1b --repeats 3 --name "$measured" \
     --out "$build/$measured.toml"; then
  profile="$(realpath "$build/$measured.toml")"  # a relative one is the experiment file's
  keep "$measured.toml"
  note "kvlab calibrate --backend cuda: $(grep -E '^fit ' "$build/calibrate.log")"
  note "  $(grep -E '^peaks:' "$build/calibrate.log")"
  note "  $(grep -E '^steps that replay no CUDA graph' "$build/calibrate.log")"
  while IFS= read -r line; do note "  $line"; done < <(grep -E '^roofline: ' "$build/calibrate.log")
else
  status=1
  note "kvlab calibrate --backend cuda FAILED"; tail -3 "$build/calibrate.log"
fi

# --- 5. end to end, the simulator's prediction of it, and Hugging Face generate()
e2e_out="$build/cuda_fcfs_vs_static"
if stage "end to end" 180 e2e.log "$kvlab" run experiments/cuda_fcfs_vs_static.toml --force \
     --out "$e2e_out" --set "backend.profile=\"$profile\""; then
  keep cuda_fcfs_vs_static
  note "end to end (tinyllama-1.1b bf16, 1,024 requests, max_batch 256, measured clock):"
  grep -E "^\|" "$build/e2e.log"
  note "  $(grep -E '^wall' "$build/e2e.log")"  # share outside forward, device picks, graphs
  while IFS= read -r line; do summary+=("$line"); done < <(grep -E '^\| scheduler' "$build/e2e.log")
  while IFS= read -r line; do note "  $line"; done < <(python3 - "$e2e_out" <<'PY'
import json, pathlib, sys
folder = pathlib.Path(sys.argv[1])
by_scheduler = {}
for run in json.loads((folder / "runs.json").read_text()):
    s = json.loads((folder / run["dir"] / "summary.json").read_text())
    by_scheduler[s["scheduler"]] = s
    if "step_time_ratio" in s:
        r, e = s["step_time_ratio"], s["step_prediction_error"]
        print(f"[{run['label']}] measured step / profile's price: p50 {r['p50']:.2f}, mean |error| "
              f"{100 * e['mean']:.1f}% over {e['count']} steps")
if "fcfs" in by_scheduler and "static" in by_scheduler:  # issue 15's target
    f, st = by_scheduler["fcfs"], by_scheduler["static"]
    print(f"fcfs / static output tok/s = {f['output_tokens_per_s'] / st['output_tokens_per_s']:.2f}"
          f" (aim >= 1.2); TTFT p50 fcfs {f['ttft_s']['p50']:.3f} s vs static "
          f"{st['ttft_s']['p50']:.3f} s (aim lower)")
PY
)
  # The simulator's prediction of the same runs: with the fitted profile, and with the
  # datasheet's (what calibrating bought).
  replays=("$profile")
  [ "$profile" != h200 ] && replays+=(h200)
  for replay in "${replays[@]}"; do
    name=$(basename "$replay" .toml)
    if stage "simulated replay ($name)" 60 "e2e_simulated_$name.log" "$kvlab" run \
         experiments/cuda_fcfs_vs_static.toml --force --out "$build/e2e_simulated_$name" \
         --set 'backend.name="simulated"' --set 'backend.params={}' \
         --set 'experiment.clock="virtual"' --set "backend.profile=\"$replay\"" &&
       python3 experiments/compare_calibration.py "$e2e_out" "$build/e2e_simulated_$name" \
         > "$build/e2e_prediction_$name.log" 2>&1; then
      keep "e2e_prediction_$name.log"
      note "simulated backend with profile $name vs the measured runs:"
      while IFS= read -r line; do note "  $line"; done < <(grep -E '^\| scheduler|predictions' "$build/e2e_prediction_$name.log")
    else
      note "simulated replay ($name) of the end-to-end run FAILED"; tail -3 "$build/e2e_simulated_$name.log"
    fi
  done
  # The same requests' lengths through generate() (a static batch of 256, as the experiment's
  # max_batch; its first 256 requests, to keep the check within its budget).
  if stage "hf generate baseline" 120 hf_baseline.log python3 scripts/hf_generate_baseline.py \
       "$e2e_out" --batch 256 --max-requests 256; then
    while IFS= read -r line; do note "$line"; done < <(grep -E '^(hf generate|kvlab \[)' "$build/hf_baseline.log")
  else
    note "hf generate baseline: not measured"; tail -3 "$build/hf_baseline.log"
  fi
else
  status=1
  note "end to end FAILED"; tail -5 "$build/e2e.log"
fi

# --- 6. bf16 on the GPU checked against the fp32 reference with the TAU docs/experiments.md
# states for it (twice the largest logit error measured on the CPU emulator); the verdict's
# logits line is the GPU's own measurement of that error. The requests ask for 5 logprobs: the
# device's log-softmax and top 5 are held to the reference's within TAU too.
tau_bf16=0.03
if stage "kvlab check bf16" 90 check_bf16.log "$kvlab" check experiments/quickstart.toml \
     --set workload.requests=100 --set workload.logprobs=5 --set 'backend.name="cuda"' \
     --set 'backend.params={dtype="bf16"}' \
     --set 'backend.profile="h200"' --tolerance "$tau_bf16"; then
  while IFS= read -r line; do note "kvlab check, cuda bf16, TAU $tau_bf16: $line"; done < <(grep -E '^kvlab check' "$build/check_bf16.log")
else
  status=1
  note "kvlab check, cuda bf16, TAU $tau_bf16 FAILED: $(grep -E '^kvlab check|error' "$build/check_bf16.log" | head -3)"
fi
note "  $(grep -m1 -E '^logits' "$build/check_bf16.log")"
# fp8 and int8 KV in the device pool (fp32 compute), with the TAU docs/experiments.md states for
# them: twice the largest logit error of the cpu backend over a pool of the same dtype.
for kv_tau in fp8:0.15 int8:0.04; do
  kv=${kv_tau%%:*} tau=${kv_tau#*:}
  if stage "kvlab check $kv KV" 90 "check_$kv.log" "$kvlab" check experiments/quickstart.toml \
       --set workload.requests=100 --set 'backend.name="cuda"' --set "kv_cache.dtype=\"$kv\"" \
       --set 'backend.profile="h200"' --tolerance "$tau"; then
    while IFS= read -r line; do note "kvlab check, cuda f32, $kv KV, TAU $tau: $line"; done < <(grep -E '^kvlab check' "$build/check_$kv.log")
  else
    status=1
    note "kvlab check, cuda f32, $kv KV, TAU $tau FAILED: $(grep -E '^kvlab check|error' "$build/check_$kv.log" | head -3)"
  fi
  note "  $(grep -m1 -E '^logits' "$build/check_$kv.log")"
done

# --- 7. compute-sanitizer
if command -v compute-sanitizer >/dev/null; then
  if stage "memcheck" 120 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 \
       "$build/tests/kvlab_cuda_tests" \
       --gtest_filter='CudaKernels.*:CudaAttention.*:*CudaAttentionGrid.*hd128_group8_block16*:*CudaEngine.*paged_gqa_swap:CudaBackend.DeviceLogprobs*'; then
    note "compute-sanitizer memcheck: clean ($(grep -cE '^\[       OK' "$build/memcheck.log") tests)"
  else
    status=1
    note "compute-sanitizer memcheck FAILED"; grep -E "Invalid|ERROR|FAILED" "$build/memcheck.log" | head -20
  fi
  # racecheck (shared-memory hazards) on the kernels that share memory across a block's threads
  # through atomics and reductions (the token choice) and tiles staged by asynchronous copies
  # (the tensor-core prefill and decode).
  if stage "racecheck" 90 racecheck.log compute-sanitizer --tool racecheck --error-exitcode 9 \
       "$build/tests/kvlab_cuda_tests" \
       --gtest_filter='CudaKernels.SampleRows*:CudaKernels.RowLogprobs*:CudaKernels.ArgmaxRows*:CudaAttention.LongPrefill*:CudaAttention.DecodeGroups*'; then
    note "compute-sanitizer racecheck (token choice and logprobs, tensor-core prefill and decode): clean"
  else
    status=1
    note "compute-sanitizer racecheck FAILED"; grep -E "hazard|ERROR|FAILED" "$build/racecheck.log" | head -20
  fi
else
  note "compute-sanitizer: not found"
fi

note "gpu_check: $(( $(date +%s) - start )) s of checks (budget $budget s), status $status"
echo
echo "===== gpu_check summary ====="
printf '%s\n' "${summary[@]}"
exit $status
