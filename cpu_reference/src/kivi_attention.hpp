#pragma once
// Decode attention over a KIVI pool (kvlab/kv/kivi_groups.hpp), read in place: a sealed group's
// keys as per-channel codes (q . k = (q * scale) . codes + q . min, the two vectors made once per
// group), its values as int2 / q4_1 rows; an open group's rows in fp16 from beside the pool.
#include "attention_rows.hpp"

#include "kvlab/kv/kivi_groups.hpp"

namespace kvlab::cpu {

#if KVLAB_ATTENTION_SIMD
// 8 codes of a sealed key row from channel d (a multiple of 8), as fp32.
template <int Bits>
__m256 kivi_codes8(const std::byte* row, std::int64_t d) {
  const std::int64_t within = d % 32;
  if constexpr (Bits == 2) {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 32 * 8)));
    return _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_srli_epi32(bytes, static_cast<int>(2 * (within / 8))), _mm256_set1_epi32(3)));
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 32 * 16 + within % 16)));
    return _mm256_cvtepi32_ps(within < 16 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xf))
                                          : _mm256_srli_epi32(bytes, 4));
  }
}

// scores[j] = scale x (q' . codes_j + c) for the rows k + j x stride, j < count; q': (hd).
template <int Bits>
void score_kivi_codes(const float* q_scaled, float c, const std::byte* k, std::int64_t stride,
                      std::int64_t count, std::int64_t hd, float scale, float* scores) {
  const std::int64_t code_bytes = kivi_code_bytes(Bits, hd);
  std::int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    for (std::int64_t r = j + 8; r < std::min(j + 16, count); ++r)  // the next 8 rows' codes
      prefetch_row(k + r * stride, code_bytes);
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q_scaled + d);
      for (int r = 0; r < 8; ++r)
        acc[r] = _mm256_fmadd_ps(qv, kivi_codes8<Bits>(k + (j + r) * stride, d), acc[r]);
    }
    const __m256 sums = _mm256_add_ps(lane_sums(acc), _mm256_set1_ps(c));
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
  }
  for (; j < count; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < hd; d += 8)
      acc =
          _mm256_fmadd_ps(_mm256_loadu_ps(q_scaled + d), kivi_codes8<Bits>(k + j * stride, d), acc);
    const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    scores[j] = (_mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1))) + c) * scale;
  }
}
#endif

// Scores of q against rows [r0, r0 + count) of a sealed key group (its 32 rows at `group`,
// `stride` bytes apart, one head's). scratch: 3 x hd floats.
inline void score_kivi_group(int bits, const float* q, const std::byte* group, std::int64_t stride,
                             std::int64_t r0, std::int64_t count, std::int64_t hd, float scale,
                             float* scores, float* scratch) {
  float *scales = scratch, *mins = scratch + hd, *row = scratch + 2 * hd;
  kivi_key_params(bits, group, stride, hd, scales, mins);
  const std::byte* k = group + r0 * stride;
#if KVLAB_ATTENTION_SIMD
  if (hd % 32 == 0) {
    float *q_scaled = row, c = 0;
    for (std::int64_t d = 0; d < hd; ++d) {
      q_scaled[d] = q[d] * scales[d];
      c += q[d] * mins[d];
    }
    if (bits == 2) return score_kivi_codes<2>(q_scaled, c, k, stride, count, hd, scale, scores);
    return score_kivi_codes<4>(q_scaled, c, k, stride, count, hd, scale, scores);
  }
#endif
  for (std::int64_t j = 0; j < count; ++j) {  // each row dequantized
    kivi_key_row_to_f32(bits, k + j * stride, hd, scales, mins, row);
    float dot = 0;
    for (std::int64_t d = 0; d < hd; ++d) dot += q[d] * row[d];
    scores[j] = dot * scale;
  }
}

// Calls f(at, r0, n, open) for each group's share of the slots [slot, slot + count): n slots from
// `at` (row r0 of its group), `open` its group's fp16 rows from `at` (nullptr: sealed).
template <typename F>
void for_each_kivi_piece(const KvPool& pool, std::int64_t layer, bool value, std::int64_t slot,
                         std::int64_t count, F&& f) {
  for (std::int64_t done = 0; done < count;) {
    const std::int64_t at = slot + done, r0 = at % kKiviGroup;
    const std::int64_t n = std::min(count - done, kKiviGroup - r0);
    f(done, at, r0, n, pool.open_row(layer, at, value));
    done += n;
  }
}

// score_rows over slots [slot, slot + count) of a KIVI pool, KV head kv_head.
inline void score_kivi_keys(const KvPool& pool, std::int64_t layer, std::int64_t kv_head,
                            const float* q, std::int64_t slot, std::int64_t count, float scale,
                            float* scores) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t hd = shape.head_dim, stride = shape.slot_row_bytes(false);
  const int bits = kivi_bits(shape.dtype);
  std::array<float, 3 * 256> stack;  // score_kivi_group's scratch
  std::vector<float> heap(hd > 256 ? static_cast<std::size_t>(3 * hd) : 0);
  float* scratch = hd > 256 ? heap.data() : stack.data();
  for_each_kivi_piece(pool, layer, false, slot, count,
                      [&](std::int64_t done, std::int64_t at, std::int64_t r0, std::int64_t n,
                          const std::uint16_t* open) {
                        if (open != nullptr)
                          return score_rows(DType::dtype_f16, q,
                                            reinterpret_cast<const std::byte*>(open + kv_head * hd),
                                            2 * shape.slot_width(), n, n, hd, scale, scores + done);
                        score_kivi_group(
                            bits, q,
                            pool.key_bytes(layer, at - r0) + kv_head * shape.head_row_bytes(false),
                            stride, r0, n, hd, scale, scores + done, scratch);
                      });
}

// add_weighted_rows over slots [slot, slot + count) of a KIVI pool, KV head kv_head.
inline void add_kivi_values(const KvPool& pool, std::int64_t layer, std::int64_t kv_head,
                            const float* p, std::int64_t slot, std::int64_t count, float* o) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t hd = shape.head_dim;
  for_each_kivi_piece(
      pool, layer, true, slot, count,
      [&](std::int64_t done, std::int64_t at, std::int64_t, std::int64_t n,
          const std::uint16_t* open) {
        if (open != nullptr)
          return add_weighted_rows(DType::dtype_f16, p + done,
                                   reinterpret_cast<const std::byte*>(open + kv_head * hd),
                                   2 * shape.slot_width(), n, n, hd, o);
        add_weighted_rows(kivi_value_dtype(shape.dtype), p + done,
                          pool.value_bytes(layer, at) + kv_head * shape.head_row_bytes(true),
                          shape.slot_row_bytes(true), n, n, hd, o);
      });
}

}  // namespace kvlab::cpu
