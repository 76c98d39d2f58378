#pragma once
// CPU emulation of the CUDA execution model (KVLAB_CUDA_EMULATION): the kernels' own source,
// compiled by g++, runs on a machine without a GPU, so CI checks the kernels' indexing, tiling,
// masking, split-K combine and bounds, not only that they compile.
//
// How: a launch runs the grid's blocks one after another on the calling OS thread; the threads
// of a block are fibers (Boost.Context) that run until they reach a barrier. __syncthreads()
// releases when every live thread of the block has arrived (exited threads count as arrived,
// as on the hardware); a warp shuffle releases when every lane of the warp has arrived, and
// then each lane reads the value its source lane offered. A barrier that can never release
// (threads of one block waiting at different barriers, a full-mask shuffle after a lane has
// exited) fails the launch with a description instead of hanging. __shared__ variables are
// `static thread_local`: one copy per OS thread, shared by the fibers of the running block.
//
// What it cannot show: timing, memory coalescing, bank conflicts, races between threads that
// the hardware would interleave differently, fast-math differences (__expf is std::exp here),
// and a missing wait for asynchronous copies (copy_async_16 copies at issue here). Those need a
// GPU: scripts/gpu_check.sh (racecheck).
#ifndef KVLAB_CUDA_EMULATION
#error "kvlab/cuda/emulation.hpp is only for the emulated build (KVLAB_CUDA_EMULATION)"
#endif

// Execution-space keywords before the CUDA headers, which keep definitions made first.
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "kvlab/cuda/emulated_capture.hpp"

namespace kvlab::cuda::emulation {

// Built-in variables of the emulated thread that is running.
struct Coordinates {
  uint3 thread_index{};
  uint3 block_index{};
  dim3 block_dim;
  dim3 grid_dim;
};
extern thread_local const Coordinates* current;

// Runs `thread_body` once for every thread of every block (see the header comment). Checks the
// launch configuration the way the driver does. Returns cudaSuccess or the error, which is
// also kept as the sticky last error; failure_message() says what went wrong.
cudaError_t launch(dim3 grid, dim3 block, const std::function<void()>& thread_body);
// Why the last failed launch failed ("" after a successful one).
const std::string& failure_message();

// __syncthreads(): waits for every live thread of the block.
void sync_block();
// A warp-wide exchange: every lane of `mask` offers `value` and receives the value offered by
// `source_lane` (its own when source_lane is outside the warp). Only full-warp masks.
std::uint64_t warp_exchange(unsigned mask, std::uint64_t value, int source_lane);

template <typename T>
T shuffle(unsigned mask, T value, int source_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_exchange(mask, bits, source_lane);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

inline int lane_id() {
  return static_cast<int>(current->thread_index.x % 32);
}

}  // namespace kvlab::cuda::emulation

#define threadIdx (::kvlab::cuda::emulation::current->thread_index)
#define blockIdx (::kvlab::cuda::emulation::current->block_index)
#define blockDim (::kvlab::cuda::emulation::current->block_dim)
#define gridDim (::kvlab::cuda::emulation::current->grid_dim)

inline void __syncthreads() {
  ::kvlab::cuda::emulation::sync_block();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::kvlab::cuda::emulation::warp_exchange(mask, 0, 0);
}
// width: the shuffle works within segments of `width` lanes, as in CUDA.
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = ::kvlab::cuda::emulation::lane_id();
  const int source = lane ^ lane_mask;
  const bool inside = source / width == lane / width;
  return ::kvlab::cuda::emulation::shuffle(mask, value, inside ? source : lane);
}
template <typename T>
T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32) {
  const int lane = ::kvlab::cuda::emulation::lane_id();
  return ::kvlab::cuda::emulation::shuffle(mask, value, lane / width * width + source_lane % width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = ::kvlab::cuda::emulation::lane_id();
  const int source = lane + static_cast<int>(delta);
  return ::kvlab::cuda::emulation::shuffle(mask, value,
                                           source / width == lane / width ? source : lane);
}

// Atomics: the threads of a block are fibers that switch only at barriers and shuffles, so a
// read-modify-write is atomic among them; blocks run one after another, so between blocks too.
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old + value;
  return old;
}
inline double atomicAdd(double* address, double value) {
  const double old = *address;
  *address = old + value;
  return old;
}

// Device math the kernels use, as their host equivalents.
inline float __expf(float x) {
  return std::exp(x);
}
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline int min(int a, int b) {
  return a < b ? a : b;
}
inline int max(int a, int b) {
  return a > b ? a : b;
}
inline std::int64_t min(std::int64_t a, std::int64_t b) {
  return a < b ? a : b;
}
inline std::int64_t max(std::int64_t a, std::int64_t b) {
  return a > b ? a : b;
}
