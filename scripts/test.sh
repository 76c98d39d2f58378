#!/usr/bin/env bash
# The README's second command: set up, build, and run the whole test suite (ctest), then the
# core and plugin tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir="${KVLAB_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"

asan_dir="${build_dir}-asan"
cmake -S . -B "$asan_dir" -DCMAKE_BUILD_TYPE=Release -DKVLAB_SANITIZE=ON -DKVLAB_WITH_CUDA=OFF \
  -DKVLAB_BUILD_BENCHMARKS=OFF
cmake --build "$asan_dir" -j "$(nproc)" --target kvlab_core_tests kvlab_plugin_tests
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir "$asan_dir" -L "core|plugins" --output-on-failure -j "$(nproc)"
