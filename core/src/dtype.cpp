#include "kvlab/dtype.hpp"

#include "kv_formats.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <array>
#include <cassert>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#define KVLAB_DTYPE_SIMD 1
#include <immintrin.h>
#endif

namespace kvlab {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view safetensors_name;
  std::string_view short_name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 19> kDTypes{{
    {DType::dtype_f64, "F64", "f64", 8},
    {DType::dtype_f32, "F32", "f32", 4},
    {DType::dtype_f16, "F16", "f16", 2},
    {DType::dtype_bf16, "BF16", "bf16", 2},
    {DType::dtype_f8_e4m3, "F8_E4M3", "fp8", 1},
    {DType::dtype_f8_e5m2, "F8_E5M2", "fp8_e5m2", 1},
    {DType::dtype_i64, "I64", "i64", 8},
    {DType::dtype_i32, "I32", "i32", 4},
    {DType::dtype_i16, "I16", "i16", 2},
    {DType::dtype_i8, "I8", "i8", 1},
    {DType::dtype_u8, "U8", "u8", 1},
    {DType::dtype_bool, "BOOL", "bool", 1},
    {DType::dtype_kv_int8, "", "int8", 0},
    {DType::dtype_q8_0, "", "q8_0", 0},
    {DType::dtype_q4_0, "", "q4_0", 0},
    {DType::dtype_q4_1, "", "q4_1", 0},
    {DType::dtype_kv_int2, "", "int2", 0},
    {DType::dtype_kivi2, "", "kivi2", 0},
    {DType::dtype_kivi4, "", "kivi4", 0},
}};

const DTypeInfo& info(DType dtype) {
  return kDTypes[static_cast<std::size_t>(dtype)];
}

template <typename T>
T load_unaligned(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

#if KVLAB_DTYPE_SIMD
// Eight values at a time, bit for bit what Eigen's scalar conversions give (F16C rounds to
// nearest even as Eigen::half does; bf16 uses Eigen's rounding and its quiet NaNs), except that
// widening a signalling f16 NaN sets its quiet bit (Eigen's keeps it: still a NaN). The first
// n / 8 * 8 values; the caller converts the rest one by one. (A KV write is one row of a few
// thousand values: the scalar loops cost 1.3% of a batch-64 decode step.)
std::size_t f16_from_f32(const float* source, std::size_t n, std::byte* target) {
  const __m128i magnitude = _mm_set1_epi16(0x7fff), infinity = _mm_set1_epi16(0x7c00),
                sign = _mm_set1_epi16(static_cast<short>(0x8000)),
                quiet_nan = _mm_set1_epi16(0x7e00);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i half =
        _mm256_cvtps_ph(_mm256_loadu_ps(source + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // F16C keeps a NaN's payload; Eigen writes the one quiet NaN with the sign.
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(half, magnitude), infinity);
    half = _mm_blendv_epi8(half, _mm_or_si128(_mm_and_si128(half, sign), quiet_nan), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(target + 2 * i), half);
  }
  return i;
}

std::size_t bf16_from_f32(const float* source, std::size_t n, std::byte* target) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                magnitude = _mm256_set1_epi32(0x7fffffff), infinity = _mm256_set1_epi32(0x7f800000),
                quiet_nan = _mm256_set1_epi32(0x7fc0), sign = _mm256_set1_epi32(0x8000);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
    const __m256i nan_bits =
        _mm256_or_si256(quiet_nan, _mm256_and_si256(_mm256_srli_epi32(bits, 16), sign));
    rounded = _mm256_blendv_epi8(rounded, nan_bits, nan);
    // 32-bit lanes (each < 2^16) to 16 bits: packus works within 128-bit halves, so reorder.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(target + 2 * i), _mm256_castsi256_si128(packed));
  }
  return i;
}

std::size_t f32_from_f16(const std::byte* source, std::size_t n, float* target) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        target + i,
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 2 * i))));
  return i;
}

std::size_t f32_from_bf16(const std::byte* source, std::size_t n, float* target) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 2 * i));
    _mm256_storeu_ps(target + i,
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
  return i;
}
#else
std::size_t f16_from_f32(const float*, std::size_t, std::byte*) {
  return 0;
}
std::size_t bf16_from_f32(const float*, std::size_t, std::byte*) {
  return 0;
}
std::size_t f32_from_f16(const std::byte*, std::size_t, float*) {
  return 0;
}
std::size_t f32_from_bf16(const std::byte*, std::size_t, float*) {
  return 0;
}
#endif

}  // namespace

std::size_t dtype_size(DType dtype) {
  return info(dtype).size;
}
std::string_view dtype_safetensors_name(DType dtype) {
  return info(dtype).safetensors_name;
}
std::string_view dtype_short_name(DType dtype) {
  return info(dtype).short_name;
}

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (!entry.safetensors_name.empty() && entry.safetensors_name == name) return entry.dtype;
  return std::nullopt;
}

std::optional<DType> dtype_from_short_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.short_name == name) return entry.dtype;
  return std::nullopt;
}

bool dtype_converts_to_f32(DType dtype) {
  return dtype == DType::dtype_f32 || dtype == DType::dtype_f16 || dtype == DType::dtype_bf16 ||
         dtype == DType::dtype_f64;
}

void convert_to_f32(DType dtype, std::span<const std::byte> source, std::span<float> destination) {
  const std::size_t n = destination.size();
  assert(static_cast<std::int64_t>(source.size()) ==
         dtype_row_bytes(dtype, static_cast<std::int64_t>(n)));
  if (n == 0) return;  // an empty tensor: its spans may be null, which memcpy must not see
  const std::byte* p = source.data();
  if (is_kv_format(dtype)) return kv_row_to_f32(dtype, p, n, destination.data());
  switch (dtype) {
    case DType::dtype_f32:
      std::memcpy(destination.data(), p, n * sizeof(float));
      return;
    case DType::dtype_f64:
      for (std::size_t i = 0; i < n; ++i)
        destination[i] = static_cast<float>(load_unaligned<double>(p + 8 * i));
      return;
    case DType::dtype_f16:
      for (std::size_t i = f32_from_f16(p, n, destination.data()); i < n; ++i)
        destination[i] = static_cast<float>(
            Eigen::numext::bit_cast<Eigen::half>(load_unaligned<std::uint16_t>(p + 2 * i)));
      return;
    case DType::dtype_bf16:
      for (std::size_t i = f32_from_bf16(p, n, destination.data()); i < n; ++i)
        destination[i] = static_cast<float>(
            Eigen::numext::bit_cast<Eigen::bfloat16>(load_unaligned<std::uint16_t>(p + 2 * i)));
      return;
    default:
      assert(false && "convert_to_f32: unsupported dtype");
  }
}

void convert_from_f32(DType dtype, std::span<const float> source,
                      std::span<std::byte> destination) {
  const std::size_t n = source.size();
  assert(static_cast<std::int64_t>(destination.size()) ==
         dtype_row_bytes(dtype, static_cast<std::int64_t>(n)));
  if (n == 0) return;
  std::byte* p = destination.data();
  if (is_kv_format(dtype)) return kv_row_from_f32(dtype, source.data(), n, p);
  switch (dtype) {
    case DType::dtype_f32:
      std::memcpy(p, source.data(), n * sizeof(float));
      return;
    case DType::dtype_f16:
      for (std::size_t i = f16_from_f32(source.data(), n, p); i < n; ++i) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(source[i]));
        std::memcpy(p + 2 * i, &bits, 2);
      }
      return;
    case DType::dtype_bf16:
      for (std::size_t i = bf16_from_f32(source.data(), n, p); i < n; ++i) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(source[i]));
        std::memcpy(p + 2 * i, &bits, 2);
      }
      return;
    default:
      assert(false && "convert_from_f32: unsupported dtype");
  }
}

}  // namespace kvlab
