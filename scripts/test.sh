#!/usr/bin/env bash
# The README's second command: set up, build, and run the whole test suite (ctest) in two builds,
# three on an AVX-512 machine (docs/building.md):
#   build/           native (-march=native), warnings as errors: every test
#   build-portable/  portable, no sanitizer: the CUDA emulator under valgrind (emulated.memcheck),
#                    which cannot decode the AVX-512 a native build contains on some machines
#                    (only there: elsewhere the native build runs emulated.memcheck itself),
#                    in the background beside the sanitizer build
#   build-sanitize/  clang, portable, -O1, AddressSanitizer + UBSan, one file per compile (no
#                    unity batches: every source compiles on its own): the core, plugin and
#                    cpu_reference tests (the plain-loop kernels that machines without AVX2 run),
#                    and libFuzzer: every input parser fuzzed for KVLAB_FUZZ_SECONDS (20) each,
#                    from the seed corpora in tests/fuzz/corpus/
set -euo pipefail
cd "$(dirname "$0")/.."
export KVLAB_WERROR=ON
export KVLAB_SETUP_BROWSER=1  # chromium for kvlab view's page test (tests/view/)
# Each stage's start, in seconds since this script began (CI keeps the whole under 30 minutes
# on 2 cores: these say where the time goes).
stage() { echo "kvlab test: [${SECONDS} s] $*"; }
stage "setup: packages, configure, build ($(nproc) cores)"
scripts/setup.sh
# The third-party data sets the tests read (docs/data.md): from ../shared/data here and in CI.
stage "data sets: scripts/get_data.sh all"
scripts/get_data.sh all
build_dir="${KVLAB_BUILD_DIR:-build}"
stage "ctest in $build_dir"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"

memcheck_pid=""
if grep -q "emulated.memcheck" "$build_dir/tests/CTestTestfile.cmake"; then
  echo "kvlab test: emulated.memcheck ran in $build_dir (no AVX-512 here): no portable build"
elif command -v valgrind >/dev/null 2>&1; then
  portable_dir="${build_dir}-portable"
  cmake -S . -B "$portable_dir" -DCMAKE_BUILD_TYPE=Release -DKVLAB_NATIVE=OFF -DKVLAB_WERROR=ON \
    -DKVLAB_BUILD_BENCHMARKS=OFF -DKVLAB_WITH_NVCC=OFF
  # (grep the test list, not `cmake --build --target help | grep -q`: under pipefail the
  # broken pipe of an early grep exit made the check fail and the stage silently skip)
  if grep -q "emulated.memcheck" "$portable_dir/tests/CTestTestfile.cmake"; then
    stage "portable build for valgrind in $portable_dir"
    cmake --build "$portable_dir" -j "$(nproc)" --target kvlab_cuda_emulated_tests
    # valgrind is one thread for ~3 minutes: it runs beside the sanitizer stage below (its own
    # process group, stopped if that stage fails), not alone on a 2-core machine.
    setsid ctest --test-dir "$portable_dir" -L memcheck --output-on-failure \
      > "$portable_dir/memcheck.log" 2>&1 &
    memcheck_pid=$!
    trap '[ -z "$memcheck_pid" ] || kill -- "-$memcheck_pid" 2>/dev/null || true' EXIT
  else
    echo "kvlab test: this build has no CUDA emulation (no CUDA headers or Boost.Context):" \
      "no valgrind run"
  fi
fi

# One clang build under AddressSanitizer + UBSan serves both: the core, plugin, cpu_reference and
# serve (kvlab serve's threads and connections) tests, and the libFuzzer harnesses (kvlab_core
# is compiled once for both, where two builds compiled it twice: ~5 of CI's minutes). -O1, as
# AddressSanitizer's documentation advises: half -O3's compile time, and UBSan keeps checks that
# -O3 folded away (it found a misaligned reference in the plugin loader that -O3 hid). clang does
# not vectorise at -O1, so every `#pragma omp simd` loop would warn that it was not
# (-Wpass-failed): not a finding here.
sanitize_dir="${build_dir}-sanitize"
stage "sanitizer build in $sanitize_dir"
CC=clang CXX=clang++ cmake -S . -B "$sanitize_dir" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG -Wno-pass-failed" -DKVLAB_FUZZ=ON -DKVLAB_WITH_CUDA=OFF \
  -DKVLAB_BUILD_BENCHMARKS=OFF -DKVLAB_NATIVE=OFF -DKVLAB_WERROR=ON -DKVLAB_UNITY_BUILD=OFF \
  -DKVLAB_FUZZ_SECONDS="${KVLAB_FUZZ_SECONDS:-20}"
# kvlab_sanitizer_suite: the core, plugin and cpu_reference tests and every fuzzer (one target,
# built in parallel; tests/fuzz/CMakeLists.txt).
cmake --build "$sanitize_dir" -j "$(nproc)" --target kvlab_sanitizer_suite
stage "sanitizer tests"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir "$sanitize_dir" -L "^(core|plugins|cpu_reference|serve)$" --output-on-failure \
  -j "$(nproc)"
# valgrind done before the fuzzers start: they run for a fixed time, which it would share.
if [ -n "$memcheck_pid" ]; then
  stage "waiting for emulated.memcheck"
  memcheck_status=0
  wait "$memcheck_pid" || memcheck_status=$?
  memcheck_pid=""
  cat "$portable_dir/memcheck.log"
  if [ "$memcheck_status" -ne 0 ]; then
    echo "kvlab test: emulated.memcheck in $portable_dir failed (exit $memcheck_status)"
    exit "$memcheck_status"
  fi
fi
stage "fuzzers"
ctest --test-dir "$sanitize_dir" -L fuzz --output-on-failure -j "$(nproc)"
stage "done"
