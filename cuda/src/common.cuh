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

#include <cmath>
#include <cstdint>
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
// The largest of the warp's values (NaNs ignored, as fmaxf ignores them).
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Round to the nearest integer, ties to even (the host's std::nearbyint in its default mode).
__device__ __forceinline__ float round_to_even(float x) {
#if defined(KVLAB_CUDA_EMULATION)
  return std::nearbyint(x);
#else
  return rintf(x);
#endif
}
__device__ __forceinline__ std::uint32_t float_bits(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
__device__ __forceinline__ float bits_float(std::uint32_t bits) {
  float x = 0;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// fp8 e4m3 (e4m3fn: bias 7, no infinities, 0x7f and 0xff NaN) to fp32, exactly.
__device__ __forceinline__ float fp8_e4m3_to_float(std::uint8_t code) {
  const std::uint32_t exponent = (code >> 3) & 0xfu, mantissa = code & 7u;
  float magnitude;
  if ((code & 0x7fu) == 0x7fu)
    magnitude = quiet_nan();
  else if (exponent == 0)
    magnitude = static_cast<float>(mantissa) * 0x1p-9f;  // subnormal: m x 2^-9
  else
    magnitude = bits_float(((exponent + 120u) << 23) | (mantissa << 20));
  return (code & 0x80u) ? -magnitude : magnitude;
}
// The nearest e4m3 code, ties to the even code, saturated at +-448 (0x7e), NaN to 0x7f: the
// host pool's rounding (kvlab::convert_from_f32, dtype f8_e4m3) bit for bit.
__device__ __forceinline__ std::uint8_t fp8_e4m3_from_float(float x) {
  if (x != x) return 0x7f;
  const std::uint8_t sign = (float_bits(x) >> 31) ? 0x80 : 0;
  const float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0x1p-6f)  // subnormal codes 0..8 are m x 2^-9 (8: the smallest normal, 2^-6)
    return sign | static_cast<std::uint8_t>(round_to_even(a * 512.0f));
  const std::uint32_t bits = float_bits(a);
  std::uint32_t code = (bits >> 20) - (120u << 3);  // exponent and the top 3 mantissa bits
  const std::uint32_t rest = bits & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (code & 1u))) ++code;  // a carry moves the exponent up
  return sign | static_cast<std::uint8_t>(code > 0x7eu ? 0x7eu : code);
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

// DISPATCH_KV_FORMAT(format, F, body): body with F a compile-time KvFormat.
#define KVLAB_DISPATCH_KV_FORMAT(FORMAT, F, ...)                               \
  do {                                                                         \
    if ((FORMAT) == ::kvlab::cuda::KvFormat::fp8_e4m3) {                       \
      constexpr ::kvlab::cuda::KvFormat F = ::kvlab::cuda::KvFormat::fp8_e4m3; \
      __VA_ARGS__                                                              \
    } else if ((FORMAT) == ::kvlab::cuda::KvFormat::int8) {                    \
      constexpr ::kvlab::cuda::KvFormat F = ::kvlab::cuda::KvFormat::int8;     \
      __VA_ARGS__                                                              \
    } else {                                                                   \
      constexpr ::kvlab::cuda::KvFormat F = ::kvlab::cuda::KvFormat::compute;  \
      __VA_ARGS__                                                              \
    }                                                                          \
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
