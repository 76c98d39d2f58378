#!/usr/bin/env bash
# Build on this (CPU) machine what scripts/gpu_check.sh runs on an NVIDIA GPU machine that has
# the driver, the CUDA toolkit and CMake but none of Debian's development packages and no
# network, and pack it so that it runs there:
#   scripts/gpu_pack.sh            -> gpu-pack/kvlab-gpu.tar.xz + gpu-pack/run.sh (git-ignored)
# On the GPU machine, from a copy of this checkout that carries gpu-pack/:
#   bash gpu-pack/run.sh           (unpacks to the same absolute paths, runs gpu_check.sh
#                                   --prebuilt with the packed libraries; extra arguments go to
#                                   the command instead: bash gpu-pack/run.sh ctest -L cuda ...)
# Host code is compiled for x86-64-v3 (AVX2, FMA, F16C: any server CPU of the H100/H200 era),
# not -march=native (this machine's AVX-512 could fault there); device code for sm_90 unless
# KVLAB_CUDA_ARCHS says otherwise. The pack holds every ELF file of the build (not CMakeFiles),
# ctest's files, the run-time data (experiments/, profiles/, data/, tests/fixtures/, scripts/),
# and the shared libraries they load other than glibc's, the C++ runtime's and CUDA's (the
# GPU machine's own). Environment: KVLAB_PACK_BUILD_DIR (default build-gpu-pack).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build="${KVLAB_PACK_BUILD_DIR:-build-gpu-pack}"
archs="${KVLAB_CUDA_ARCHS:-90}"
out="$root/gpu-pack"
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "gpu_pack: nvcc not found (CUDA toolkit at /usr/local/cuda?)" >&2; exit 1; }

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVLAB_NATIVE=OFF \
  -DCMAKE_CXX_FLAGS="-march=x86-64-v3" -DCMAKE_CUDA_ARCHITECTURES="$archs" >/dev/null
# shellcheck disable=SC2207
targets=($(scripts/gpu_check.sh --targets))
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
files="$stage/files"
find "$root/$build" -path '*/CMakeFiles' -prune -o -type f -print | while read -r f; do
  case "$f" in
    *.o | *.a) ;;
    *.cmake) echo "$f" ;;  # CTestTestfile.cmake and the discovered gtest lists: ctest reads them
    *) if [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = "177ELF" ]; then echo "$f"; fi ;;
  esac
done >"$files"
# The sonames the loader asks for (libkvlab_*.so.0 -> libkvlab_*.so.0.1.0) are links: pack them.
find "$root/$build" -path '*/CMakeFiles' -prune -o -type l -name '*.so*' -print >>"$files"
for d in experiments profiles data tests/fixtures scripts; do
  [ -d "$root/$d" ] && find "$root/$d" -type f >>"$files"
done

# The libraries the packed programs load, except the system's C/C++ runtime and CUDA's.
libs="$root/$build/packed-libs"
mkdir -p "$stage$libs"
grep "^$root/$build/" "$files" | while read -r f; do ldd "$f" 2>/dev/null || true; done |
  awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
  grep -vE '/(libcuda|libcudart|libcublas|libcublasLt|libnvidia[^/]*|libnvrtc[^/]*)\.so' |
  grep -v "^$root/$build/" | while read -r lib; do cp -L "$lib" "$stage$libs/"; done

mkdir -p "$out"
tar -C / -cf "$stage/pack.tar" --files-from=<(sed 's|^/||' "$files")
tar -C "$stage" -rf "$stage/pack.tar" "${libs#/}"
xz -T0 -6 -c "$stage/pack.tar" >"$out/kvlab-gpu.tar.xz"
cat >"$out/run.sh" <<EOF
#!/usr/bin/env bash
# Made by scripts/gpu_pack.sh: unpack the build to its absolute paths and run the GPU check
# (or the command given) in $root with the packed libraries and the machine's CUDA.
set -uo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
tar -C / -xJf "\$here/kvlab-gpu.tar.xz" || { echo "gpu-pack: unpack failed"; exit 1; }
cuda_libs=\$(dirname "\$(find /usr/local/cuda/ /usr/lib /opt -name 'libcublas.so.*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$libs:\$cuda_libs:\${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:\$PATH"
cd "$root" || exit 1
if [ \$# -eq 0 ]; then
  KVLAB_BUILD_DIR="$build" exec scripts/gpu_check.sh --prebuilt
fi
exec "\$@"
EOF
chmod +x "$out/run.sh"
echo "gpu_pack: $(wc -l <"$files") files and $(find "$stage$libs" -type f | wc -l) libraries" \
  "in $out/kvlab-gpu.tar.xz ($(du -h "$out/kvlab-gpu.tar.xz" | cut -f1)); run: bash gpu-pack/run.sh"
