#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU: build with CUDA, run every CUDA test (which
# compare kernels against the Eigen reference), and print a summary. Prints the device first.
# Usage: scripts/gpu_check.sh   (needs nvcc; set CMAKE_CUDA_ARCHITECTURES via KVLAB_CMAKE_ARGS)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: no GPU visible"
export KVLAB_BUILD_DIR="${KVLAB_BUILD_DIR:-build-gpu}"
KVLAB_CMAKE_ARGS="${KVLAB_CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}" scripts/setup.sh
status=0
ctest --test-dir "$KVLAB_BUILD_DIR" -L cuda --output-on-failure || status=$?
echo "== summary =="
ctest --test-dir "$KVLAB_BUILD_DIR" -L cuda -N | tail -1
"$KVLAB_BUILD_DIR/tests/kvlab_cuda_tests" --gtest_brief=1 2>&1 | tail -5
exit $status
