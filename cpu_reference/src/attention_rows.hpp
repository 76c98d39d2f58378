#pragma once
// The two inner loops of decode attention over K/V rows read in place from the pool (rows
// `stride` bytes apart, each head's row in the pool's dtype: f32, f16, bf16, fp8 e4m3, or a
// quantized row (int8 with its scale, q8_0 / q4_0 blocks) dequantized in registers as it is
// read): scores of one query against a run of keys, and the weighted sum of a run of values.
// AVX2 + FMA (+ F16C) when head_dim is a multiple of 8; plain loops over rows widened with
// convert_to_f32 otherwise.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvlab/dtype.hpp"
#include "kvlab/kv_pool.hpp"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_ATTENTION_SIMD 1
#include <immintrin.h>
#endif

namespace kvlab::cpu {

#if KVLAB_ATTENTION_SIMD
// Every cache line of `bytes` bytes from `row`: a head's slice of a slot row is several lines,
// and rows a slot apart defeat the hardware's next-line prefetch.
inline void prefetch_row(const std::byte* row, std::int64_t bytes) {
  for (std::int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + b), _MM_HINT_T0);
}

// Calls f(std::integral_constant<DType, T>) for the pool dtype T = dtype: one instantiation of
// the row kernels per dtype.
template <typename F>
void with_row_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::dtype_f16:
      return f(std::integral_constant<DType, DType::dtype_f16>{});
    case DType::dtype_bf16:
      return f(std::integral_constant<DType, DType::dtype_bf16>{});
    case DType::dtype_f8_e4m3:
      return f(std::integral_constant<DType, DType::dtype_f8_e4m3>{});
    case DType::dtype_kv_int8:
      return f(std::integral_constant<DType, DType::dtype_kv_int8>{});
    case DType::dtype_q8_0:
      return f(std::integral_constant<DType, DType::dtype_q8_0>{});
    case DType::dtype_q4_0:
      return f(std::integral_constant<DType, DType::dtype_q4_0>{});
    case DType::dtype_q4_1:
      return f(std::integral_constant<DType, DType::dtype_q4_1>{});
    case DType::dtype_kv_int2:
      return f(std::integral_constant<DType, DType::dtype_kv_int2>{});
    default:
      return f(std::integral_constant<DType, DType::dtype_f32>{});
  }
}

inline float half_scale(const std::byte* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 8 int8 values from p, widened to fp32.
inline __m256 int8x8(const std::byte* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

// A dtype whose rows have one scale (int8): the kernels multiply sums and weights by it once
// per row, and load its values unscaled (load_row8's results times row_scale). A block-scaled
// dtype (q8_0, q4_0, q4_1, int2): the same per block of 32 (block_scale), and an asymmetric one
// (q4_1, int2: x = code x scale + min) adds its block's min times the block's query sum or
// weight (block_min).
template <DType Type>
constexpr bool kRowScaled = Type == DType::dtype_kv_int8 || Type == DType::dtype_f8_e4m3;
template <DType Type>
float row_scale(const std::byte* row) {
  float scale = 1;
  if constexpr (Type == DType::dtype_f8_e4m3) scale = 256.0f;  // load_row8 gives value / 2^8
  if constexpr (Type == DType::dtype_kv_int8) std::memcpy(&scale, row, 4);
  return scale;
}
template <DType Type>
constexpr bool kAsymmetric = Type == DType::dtype_q4_1 || Type == DType::dtype_kv_int2;
template <DType Type>
constexpr bool kBlockScaled =
    Type == DType::dtype_q8_0 || Type == DType::dtype_q4_0 || kAsymmetric<Type>;
template <DType Type>
constexpr std::int64_t kBlockBytes = Type == DType::dtype_q8_0   ? 34
                                     : Type == DType::dtype_q4_0 ? 18
                                     : Type == DType::dtype_q4_1 ? 20
                                                                 : 12;
template <DType Type>
float block_scale(const std::byte* row, std::int64_t block) {
  return half_scale(row + block * kBlockBytes<Type>);
}
template <DType Type>
float block_min(const std::byte* row, std::int64_t block) {
  return half_scale(row + block * kBlockBytes<Type> + 2);
}

// 8 values of a head's row from stored position d (a multiple of 8), widened to fp32: what
// convert_to_f32 gives for them, bit for bit (divided by row_scale for kRowScaled dtypes, by
// their block's block_scale for kBlockScaled ones).
template <DType Type>
__m256 load_row8(const std::byte* row, std::int64_t d) {
  if constexpr (Type == DType::dtype_f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (Type == DType::dtype_f16 || Type == DType::dtype_bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
    if constexpr (Type == DType::dtype_f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (Type == DType::dtype_f8_e4m3) {
    // e4m3 -> f16 by shifts: sign to bit 15, exponent and mantissa under f16's (bits 7-13);
    // the f16 is the value / 2^8 (biases 15 and 7), subnormals included, so F16C widens it
    // exactly and row_scale's 2^8 restores it. NaN codes (0x7f, 0xff) become f16 NaN.
    const __m128i codes =
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
    const __m128i magnitude = _mm_and_si128(codes, _mm_set1_epi16(0x7f));
    __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x80)), 8),
                                _mm_slli_epi16(magnitude, 7));
    half = _mm_blendv_epi8(half, _mm_set1_epi16(0x7e00),
                           _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f)));
    return _mm256_cvtph_ps(half);                       // unscaled: x row_scale<Type>(row) = 2^8
  } else if constexpr (Type == DType::dtype_kv_int8) {  // [fp32 scale][head_dim int8]
    return int8x8(row + 4 + d);                         // unscaled: x row_scale<Type>(row)
  } else if constexpr (Type == DType::dtype_q8_0) {     // blocks of [fp16 scale][32 int8]
    return int8x8(row + d / 32 * 34 + 2 + d % 32);  // unscaled: x block_scale<Type>(row, d / 32)
  } else if constexpr (Type == DType::dtype_kv_int2) {  // [scale][min][8 bytes of 4 codes]
    const std::int64_t within = d % 32;                 // codes within..+7: one shift
    const __m256i bytes = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 32 * 12 + 4)));
    const __m256i codes = _mm256_and_si256(
        _mm256_srli_epi32(bytes, static_cast<int>(2 * (within / 8))), _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(codes);  // unscaled, without the min
  } else {  // q4_0 / q4_1: [fp16 scale](q4_1: [fp16 min])[16 bytes]: j < 16 low nibble, else high
    static_assert(Type == DType::dtype_q4_0 || Type == DType::dtype_q4_1);
    const std::byte* codes = row + d / 32 * kBlockBytes<Type> + (Type == DType::dtype_q4_0 ? 2 : 4);
    const std::int64_t within = d % 32;
    const __m256i bytes = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + within % 16)));
    const __m256i nibbles =
        within < 16 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xf)) : _mm256_srli_epi32(bytes, 4);
    if constexpr (Type == DType::dtype_q4_1) return _mm256_cvtepi32_ps(nibbles);  // without min
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(nibbles, _mm256_set1_epi32(8)));   // unscaled
  }
}

// Where key channel d sits in a stored key row (pairs_key_channels).
template <DType Type>
std::int64_t stored_key_position(std::int64_t d, std::int64_t hd) {
  if constexpr (kBlockScaled<Type>) return paired_key_position(d, hd);
  return d;
}

// The 8 lanes' sums of acc[0..7], in order: hadd pairs, then the 128-bit halves of keys 0-3 and
// 4-7 added.
inline __m256 lane_sums(const __m256 (&acc)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// The key channel at stored position s of a key row (the inverse of stored_key_position).
template <DType Type>
std::int64_t key_channel_at(std::int64_t s, std::int64_t hd) {
  if constexpr (kBlockScaled<Type>) {
    const std::int64_t block = s / 32, within = s % 32;
    return within < 16 ? 16 * block + within : hd / 2 + 16 * block + within - 16;
  }
  return s;
}

// The fp16 field `offset` bytes into block b of 8 rows `stride` apart (a block's scale: 0; its
// min: 2), widened together: 8 16-bit loads and one conversion.
template <DType Type>
__m256 block_fields(const std::byte* rows, std::int64_t stride, std::int64_t b, int offset) {
  std::uint16_t bits[8];
  for (int r = 0; r < 8; ++r)
    std::memcpy(&bits[r], rows + r * stride + b * kBlockBytes<Type> + offset, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
}

// For an asymmetric dtype, the sum of q over each block's channels (x = code x scale + min, so
// q . x adds min x that sum a block); zeros for the others. Up to kMostBlocks blocks (head_dim
// 1024; score_rows takes the plain loop beyond).
constexpr std::int64_t kMostBlocks = 32;
template <DType Type>
std::array<float, kMostBlocks> block_query_sums(const float* q, std::int64_t hd) {
  std::array<float, kMostBlocks> sums{};
  if constexpr (kAsymmetric<Type>)
    for (std::int64_t s = 0; s < hd; ++s)
      sums[static_cast<std::size_t>(s / 32)] += q[key_channel_at<Type>(s, hd)];
  return sums;
}

// score_rows_simd for a block-scaled dtype: each block's 8 sums (unscaled values) times the 8
// rows' scales of that block, plus (asymmetric) their mins times the block's query sum, added up.
template <DType Type>
void score_blocks_simd(const float* q, const std::byte* k, std::int64_t stride, std::int64_t count,
                       std::int64_t readable, std::int64_t hd, float scale, float* scores) {
  const std::int64_t row_bytes = dtype_row_bytes(Type, hd), blocks = hd / 32;
  const std::array<float, kMostBlocks> q_sums = block_query_sums<Type>(q, hd);
  std::int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    for (std::int64_t r = j + 8; r < std::min(j + 16, readable); ++r)
      prefetch_row(k + r * stride, row_bytes);
    const std::byte* rows = k + j * stride;
    __m256 total = _mm256_setzero_ps();
    for (std::int64_t b = 0; b < blocks; ++b) {
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (std::int64_t s = 32 * b; s < 32 * b + 32; s += 8) {
        const __m256 qv = _mm256_loadu_ps(q + key_channel_at<Type>(s, hd));
        for (int r = 0; r < 8; ++r)
          acc[r] = _mm256_fmadd_ps(qv, load_row8<Type>(rows + r * stride, s), acc[r]);
      }
      total = _mm256_fmadd_ps(lane_sums(acc), block_fields<Type>(rows, stride, b, 0), total);
      if constexpr (kAsymmetric<Type>)
        total = _mm256_fmadd_ps(block_fields<Type>(rows, stride, b, 2),
                                _mm256_set1_ps(q_sums[static_cast<std::size_t>(b)]), total);
    }
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(total, _mm256_set1_ps(scale)));
  }
  for (; j < count; ++j) {  // the last keys, one at a time
    const std::byte* row = k + j * stride;
    float dot = 0;
    for (std::int64_t b = 0; b < blocks; ++b) {
      __m256 acc = _mm256_setzero_ps();
      for (std::int64_t s = 32 * b; s < 32 * b + 32; s += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + key_channel_at<Type>(s, hd)),
                              load_row8<Type>(row, s), acc);
      const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
      dot += _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1))) *
             block_scale<Type>(row, b);
      if constexpr (kAsymmetric<Type>)
        dot += block_min<Type>(row, b) * q_sums[static_cast<std::size_t>(b)];
    }
    scores[j] = dot * scale;
  }
}

template <DType Type>
void score_rows_simd(const float* q, const std::byte* k, std::int64_t stride, std::int64_t count,
                     std::int64_t readable, std::int64_t hd, float scale, float* scores) {
  if constexpr (kBlockScaled<Type>)
    return score_blocks_simd<Type>(q, k, stride, count, readable, hd, scale, scores);
  std::int64_t j = 0;
  const std::int64_t row_bytes = dtype_row_bytes(Type, hd);
  for (; j + 8 <= count; j += 8) {  // 8 keys at once, reduced together
    // The next 8 rows, ahead of use, while they belong to the run: the slots after a paged
    // block may be another sequence's (blocks grown in lockstep), and fetching 8 of them per
    // 16-row block would read half as much again of this head's K.
    for (std::int64_t r = j + 8; r < std::min(j + 16, readable); ++r)
      prefetch_row(k + r * stride, row_bytes);
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      const std::int64_t at = stored_key_position<Type>(d, hd);
      for (int r = 0; r < 8; ++r)
        acc[r] = _mm256_fmadd_ps(qv, load_row8<Type>(k + (j + r) * stride, at), acc[r]);
    }
    __m256 sums = lane_sums(acc);
    if constexpr (kRowScaled<Type>) {
      const std::byte* rows = k + j * stride;
      sums = _mm256_mul_ps(
          sums,
          _mm256_setr_ps(row_scale<Type>(rows), row_scale<Type>(rows + stride),
                         row_scale<Type>(rows + 2 * stride), row_scale<Type>(rows + 3 * stride),
                         row_scale<Type>(rows + 4 * stride), row_scale<Type>(rows + 5 * stride),
                         row_scale<Type>(rows + 6 * stride), row_scale<Type>(rows + 7 * stride)));
    }
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
  }
  for (; j < count; ++j) {  // the last keys, one at a time
    __m256 acc = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < hd; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d),
                            load_row8<Type>(k + j * stride, stored_key_position<Type>(d, hd)), acc);
    const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    scores[j] = _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1))) *
                row_scale<Type>(k + j * stride) * scale;
  }
}

// o[0 : 8 Vectors] += sum_j p[j] * v_j[0 : 8 Vectors]: the accumulators stay in registers.
// (Vectors 8: c0 is a multiple of 64, two blocks of 32; Vectors 1: one block.) An asymmetric
// dtype's mins are the same for a block's 32 columns: sum_j p[j] x min_j is summed once a block
// and added to its columns at the end.
template <DType Type, int Vectors>
void add_weighted_columns(const float* p, const std::byte* v, std::int64_t stride,
                          std::int64_t count, std::int64_t readable, std::int64_t c0,
                          std::int64_t row_bytes, float* o) {
  __m256 acc[Vectors];
  float min_sums[2] = {0, 0};  // per block of these columns: sum_j p[j] x its min
  for (int s = 0; s < Vectors; ++s) acc[s] = _mm256_loadu_ps(o + 8 * s);
  for (std::int64_t j = 0; j < count; ++j) {
    if (c0 == 0 && (Vectors == 8 || j % 8 == 0) && j + 4 < readable)
      prefetch_row(v + (j + 4) * stride, row_bytes);
    const std::byte* row = v + j * stride;
    __m256 weight = _mm256_set1_ps(p[j] * row_scale<Type>(row));
    for (int s = 0; s < Vectors; ++s) {
      if constexpr (kBlockScaled<Type>)  // each block of 32 values: its own scale (and min)
        if ((c0 + 8 * s) % 32 == 0 || s == 0) {
          weight = _mm256_set1_ps(p[j] * block_scale<Type>(row, (c0 + 8 * s) / 32));
          if constexpr (kAsymmetric<Type>)
            min_sums[s / 4] += p[j] * block_min<Type>(row, (c0 + 8 * s) / 32);
        }
      acc[s] = _mm256_fmadd_ps(weight, load_row8<Type>(row, c0 + 8 * s), acc[s]);
    }
  }
  for (int s = 0; s < Vectors; ++s) {
    if constexpr (kAsymmetric<Type>)
      acc[s] = _mm256_add_ps(acc[s], _mm256_set1_ps(min_sums[s / 4]));
    _mm256_storeu_ps(o + 8 * s, acc[s]);
  }
}

template <DType Type>
void add_weighted_rows_simd(const float* p, const std::byte* v, std::int64_t stride,
                            std::int64_t count, std::int64_t readable, std::int64_t hd, float* o) {
  const std::int64_t row_bytes = dtype_row_bytes(Type, hd);
  std::int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64)
    add_weighted_columns<Type, 8>(p, v, stride, count, readable, c0, row_bytes, o + c0);
  for (; c0 < hd; c0 += 8)
    add_weighted_columns<Type, 1>(p, v, stride, count, readable, c0, row_bytes, o + c0);
}
#endif

// Asks for `bytes` consecutive bytes to be brought into cache (a hint; no-op without SSE).
inline void prefetch_bytes(const std::byte* first, std::int64_t bytes) {
#if KVLAB_ATTENTION_SIMD
  for (std::int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(first + b), _MM_HINT_T1);
#else
  (void)first;
  (void)bytes;
#endif
}

// A value row (hd values) widened to fp32 in `out` (key rows: key_row_to_f32).
inline void widen_attention_row(DType dtype, const std::byte* row, std::int64_t hd, float* out) {
  const auto n = static_cast<std::size_t>(hd);
  convert_to_f32(dtype, {row, static_cast<std::size_t>(dtype_row_bytes(dtype, hd))}, {out, n});
}

// scores[j] = scale * (q . k_j), k_j = k + j * stride bytes, for j in [0, count); q: (hd).
// Rows [0, readable) (readable >= count) are the run's: the ones that may be fetched ahead.
inline void score_rows(DType dtype, const float* q, const std::byte* k, std::int64_t stride,
                       std::int64_t count, std::int64_t readable, std::int64_t hd, float scale,
                       float* scores) {
#if KVLAB_ATTENTION_SIMD
  if (hd % 8 == 0 && hd <= 32 * kMostBlocks)
    return with_row_type(dtype, [&](auto type) {
      score_rows_simd<decltype(type)::value>(q, k, stride, count, readable, hd, scale, scores);
    });
#else
  (void)readable;
#endif
  std::vector<float> row(static_cast<std::size_t>(hd));
  for (std::int64_t j = 0; j < count; ++j) {
    key_row_to_f32(dtype, k + j * stride, hd, row.data());
    float dot = 0;
    for (std::int64_t d = 0; d < hd; ++d) dot += q[d] * row[static_cast<std::size_t>(d)];
    scores[j] = dot * scale;
  }
}

// o += sum_j p[j] * v_j, v_j = v + j * stride bytes, for j in [0, count); o: (hd). Rows
// [0, readable) may be fetched ahead, as in score_rows.
inline void add_weighted_rows(DType dtype, const float* p, const std::byte* v, std::int64_t stride,
                              std::int64_t count, std::int64_t readable, std::int64_t hd,
                              float* o) {
#if KVLAB_ATTENTION_SIMD
  if (hd % 8 == 0)
    return with_row_type(dtype, [&](auto type) {
      add_weighted_rows_simd<decltype(type)::value>(p, v, stride, count, readable, hd, o);
    });
#else
  (void)readable;
#endif
  std::vector<float> row(static_cast<std::size_t>(hd));
  for (std::int64_t j = 0; j < count; ++j) {
    widen_attention_row(dtype, v + j * stride, hd, row.data());
    for (std::int64_t d = 0; d < hd; ++d) o[d] += p[j] * row[static_cast<std::size_t>(d)];
  }
}

}  // namespace kvlab::cpu
