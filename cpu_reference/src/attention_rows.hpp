#pragma once
// The two inner loops of decode attention over K/V rows read in place from the pool (rows
// `stride` floats apart): scores of one query against a run of keys, and the weighted sum of a
// run of values. AVX2 + FMA when head_dim is a multiple of 8, plain loops otherwise.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvlab::cpu {

// scores[j] = scale * (q . k_j), k_j = k + j * stride, for j in [0, count); q: (hd).
inline void score_rows(const float* q, const float* k, std::int64_t stride, std::int64_t count,
                       std::int64_t hd, float scale, float* scores) {
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (hd % 8 == 0) {
    for (; j + 8 <= count; j += 8) {  // 8 keys at once, reduced together
      for (int r = 0; r < 8; ++r)      // the next 8 rows' first lines, ahead of use (x86
        _mm_prefetch(reinterpret_cast<const char*>(k + (j + 8 + r) * stride),  // prefetches
                     _MM_HINT_T0);                                               // never fault)
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (std::int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int r = 0; r < 8; ++r)
          acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + r) * stride + d), acc[r]);
      }
      // Lane sums: hadd pairs, then the 128-bit halves of keys 0-3 and 4-7 added.
      const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                        _mm256_permute2f128_ps(t0, t1, 0x31));
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; j < count; ++j) {
    float dot = 0;
    for (std::int64_t d = 0; d < hd; ++d) dot += q[d] * k[j * stride + d];
    scores[j] = dot * scale;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// o[0 : 8 Vectors] += sum_j p[j] * v_j[0 : 8 Vectors]: the accumulators stay in registers.
template <int Vectors>
void add_weighted_columns(const float* p, const float* v, std::int64_t stride, std::int64_t count,
                          float* o) {
  __m256 acc[Vectors];
  for (int s = 0; s < Vectors; ++s) acc[s] = _mm256_loadu_ps(o + 8 * s);
  for (std::int64_t j = 0; j < count; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(v + (j + 4) * stride), _MM_HINT_T0);
    const __m256 weight = _mm256_set1_ps(p[j]);
    for (int s = 0; s < Vectors; ++s)
      acc[s] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + j * stride + 8 * s), acc[s]);
  }
  for (int s = 0; s < Vectors; ++s) _mm256_storeu_ps(o + 8 * s, acc[s]);
}
#endif

// o += sum_j p[j] * v_j, v_j = v + j * stride, for j in [0, count); o: (hd).
inline void add_weighted_rows(const float* p, const float* v, std::int64_t stride,
                              std::int64_t count, std::int64_t hd, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  if (hd % 8 == 0) {
    std::int64_t c0 = 0;
    for (; c0 + 64 <= hd; c0 += 64) add_weighted_columns<8>(p, v + c0, stride, count, o + c0);
    for (; c0 < hd; c0 += 8) add_weighted_columns<1>(p, v + c0, stride, count, o + c0);
    return;
  }
#endif
  for (std::int64_t j = 0; j < count; ++j)
    for (std::int64_t d = 0; d < hd; ++d) o[d] += p[j] * v[j * stride + d];
}

}  // namespace kvlab::cpu
