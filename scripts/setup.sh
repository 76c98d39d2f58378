#!/usr/bin/env bash
# kvlab setup: install missing Debian packages (idempotent, non-interactive), configure and build.
# Usage: scripts/setup.sh            (build dir: ./build, or $KVLAB_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake pkg-config git
  libeigen3-dev libopenblas-openmp-dev libboost-dev libboost-context-dev libtomlplusplus-dev libcli11-dev libfmt-dev nlohmann-json3-dev libsentencepiece-dev
  libpcre2-dev libutf8proc-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  python3 python3-matplotlib python3-pandas python3-venv valgrind
  clang libclang-rt-14-dev
  libjs-chart.js
)
# KVLAB_SETUP_BROWSER=1 (scripts/test.sh): a headless browser for kvlab view's page test.
[ "${KVLAB_SETUP_BROWSER:-0}" = 1 ] && packages+=(chromium chromium-driver)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "kvlab setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUDA parts build whenever nvcc is found (the toolkit's default place included).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# KVLAB_SETUP_PACKAGES_ONLY=1: stop here (scripts/gpu_check.sh builds only what it needs).
[ "${KVLAB_SETUP_PACKAGES_ONLY:-0}" = 1 ] && exit 0

build_dir="${KVLAB_BUILD_DIR:-build}"
echo "kvlab setup: [${SECONDS} s] packages ready; configure and build in $build_dir"
# KVLAB_WERROR=ON (scripts/test.sh, CI): kvlab's own warnings fail the build.
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVLAB_WERROR="${KVLAB_WERROR:-OFF}" \
  ${KVLAB_CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$(nproc)"
