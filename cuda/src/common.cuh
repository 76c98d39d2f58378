#pragma once
// Device helpers shared by the kernels: element conversion, the launch helper and dispatch
// macros. The same sources build for the GPU (nvcc) and for the CPU emulator (g++ with
// KVLAB_CUDA_EMULATION, see kvlab/cuda/emulation.hpp).
#if defined(KVLAB_CUDA_EMULATION)
#include "kvlab/cuda/emulation.hpp"
#else
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#endif

#include <cstring>
#include <limits>

#include "kvlab/cuda/kernels.hpp"

namespace kvlab::cuda {

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);  // round to nearest even
}

__device__ __forceinline__ float quiet_nan() {
#if defined(KVLAB_CUDA_EMULATION)
  return std::numeric_limits<float>::quiet_NaN();
#else
  return __int_as_float(0x7fc00000);
#endif
}
__device__ __forceinline__ bool is_finite(float x) {
#if defined(KVLAB_CUDA_EMULATION)
  return std::isfinite(x);
#else
  return isfinite(x);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Asynchronous 16-byte copies from global to shared memory (cp.async.cg, sm_80+): issue, then
// commit the issued copies as a group, then wait until at most `pending` groups are still in
// flight (and __syncthreads before other threads read them). `valid` false fills 16 zero
// bytes and reads nothing. The emulator copies at issue: waiting is then free.
__device__ __forceinline__ void copy_async_16(void* shared, const void* global, bool valid) {
#if defined(KVLAB_CUDA_EMULATION)
  if (valid)
    std::memcpy(shared, global, 16);
  else
    std::memset(shared, 0, 16);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if !defined(KVLAB_CUDA_EMULATION)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int pending>
__device__ __forceinline__ void copy_async_wait() {
#if !defined(KVLAB_CUDA_EMULATION)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// Launches kernel<<<grid, block, 0, stream>>>(args...) and returns the launch status; under
// the emulator the grid runs on the CPU before this returns.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                          const Args&... args) {
#if defined(KVLAB_CUDA_EMULATION)
  (void)stream;
  // By value: a captured launch (CUDA graph) runs after this returns.
  return emulation::launch(grid, block, [kernel, args...] { kernel(args...); });
#else
  // clang-format off
  kernel<<<grid, block, 0, stream>>>(args...);
  // clang-format on
  return cudaGetLastError();
#endif
}

inline unsigned blocks_for(std::int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace kvlab::cuda

// DISPATCH_DTYPE(dtype, T, body): body with T = float or __nv_bfloat16.
#define KVLAB_DISPATCH_DTYPE(DTYPE, T, ...)     \
  do {                                          \
    if ((DTYPE) == ::kvlab::cuda::Dtype::f32) { \
      using T = float;                          \
      __VA_ARGS__                               \
    } else {                                    \
      using T = __nv_bfloat16;                  \
      __VA_ARGS__                               \
    }                                           \
  } while (0)

// DISPATCH_HEAD_DIM(head_dim, HD, body): HD a compile-time head size; unsupported sizes return
// cudaErrorInvalidValue from the enclosing launcher.
#define KVLAB_HEAD_DIM_CASE(VALUE, HD, ...) \
  case VALUE: {                             \
    constexpr int HD = VALUE;               \
    __VA_ARGS__                             \
  } break;
#define KVLAB_DISPATCH_HEAD_DIM(HEAD_DIM, HD, ...) \
  switch (HEAD_DIM) {                              \
    KVLAB_HEAD_DIM_CASE(16, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(32, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(48, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(64, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(80, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(96, HD, __VA_ARGS__)       \
    KVLAB_HEAD_DIM_CASE(128, HD, __VA_ARGS__)      \
    KVLAB_HEAD_DIM_CASE(256, HD, __VA_ARGS__)      \
    default:                                       \
      return cudaErrorInvalidValue;                \
  }

// DISPATCH_GROUP(queries_per_block, QPB, body): query heads sharing one K/V head that one block
// serves together (1, 2, 4 or 8: the largest power of two <= 8 dividing the group size).
#define KVLAB_GROUP_CASE(VALUE, QPB, ...) \
  case VALUE: {                           \
    constexpr int QPB = VALUE;            \
    __VA_ARGS__                           \
  } break;
#define KVLAB_DISPATCH_GROUP(QUERIES_PER_BLOCK, QPB, ...) \
  switch (QUERIES_PER_BLOCK) {                            \
    KVLAB_GROUP_CASE(1, QPB, __VA_ARGS__)                 \
    KVLAB_GROUP_CASE(2, QPB, __VA_ARGS__)                 \
    KVLAB_GROUP_CASE(4, QPB, __VA_ARGS__)                 \
    KVLAB_GROUP_CASE(8, QPB, __VA_ARGS__)                 \
    default:                                              \
      return cudaErrorInvalidValue;                       \
  }
