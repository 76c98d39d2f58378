// y (+)= x w^T for Q8_0/Q4_0/Q4_1 weights in the interleaved layout (interleaved.hpp), with x
// rounded per 32-value block to 8-bit integers first (llama.cpp's q8_0/q8_1 activations):
//   x_b ~ dx_b * qx_b,  qx_b = round(x_b / dx_b) in [-127, 127],  dx_b = max|x_b| / 127
// and each block's dot product taken in integers:
//   Q4_0/Q4_1  w_b = d * u + m (u the nibbles, Q4_0: m = -8 d)
//              w_b . x_b ~ d dx (u . qx) + m (dx sum(qx))
//   Q8_0       w_b = d * v (v int8); VNNI multiplies unsigned by signed bytes, so qx + 128 is
//              the unsigned side:  v . qx = v . (qx + 128) - 128 sum(v)
// With AVX-512 VNNI, one vpdpbusd sums 4 values for 16 outputs; register tiles of up to 8 rows
// of x share each block's widened nibbles. With AVX2, vpmaddubsw + vpmaddwd do the same for 8
// outputs (half a group; tiles of 3 rows take both halves); Q8_0 takes the signs of the weights
// onto the activations there (|v| . sign(qx, v)), so the 16-bit pair sums stay below
// 2 * 128 * 127 and cannot saturate.
// Elsewhere the same integer sums in plain loops. Every path sums the same integers and rounds
// in the same order: their outputs are identical.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVLAB_Q8_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_Q8_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "interleaved.hpp"
#include "kvlab/dtype.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

using q8::group_block_layout;
using q8::GroupBlockLayout;
using q8::kBlockValues;
using q8::kGroupRows;

// VNNI multiplies unsigned by signed bytes: there Q8_0's activations are stored + 128.
#if KVLAB_Q8_VNNI
constexpr bool kUnsignedQ8Activations = true;
#else
constexpr bool kUnsignedQ8Activations = false;
#endif

// Value k (0-31) of a row-major Q block, as an integer: Q8_0 signed, Q4 the unsigned nibble.
int block_value(WeightFormat format, const std::byte* block, int k) {
  if (format == WeightFormat::q8_0) return static_cast<std::int8_t>(block[2 + k]);
  const std::byte* qs = block + (format == WeightFormat::q4_1 ? 4 : 2);
  const auto byte = std::to_integer<int>(qs[k % 16]);
  return k < 16 ? byte & 0x0F : byte >> 4;
}

// One row's block (row-major Q bytes) into row j of a group's block.
void pack_row_block(WeightFormat format, const std::byte* block, int j, std::byte* out) {
  const GroupBlockLayout layout = group_block_layout(format);
  std::memcpy(out + 2 * j, block, 2);  // d
  if (layout.minimums >= 0) std::memcpy(out + layout.minimums + 2 * j, block + 2, 2);
  std::int16_t sum = 0;
  for (int k = 0; k < kBlockValues; ++k) {
    const int v = block_value(format, block, k), t = k / 4, i = k % 4;
    if (format == WeightFormat::q8_0) {
      out[layout.values + 64 * t + 4 * j + i] = static_cast<std::byte>(v);
      sum = static_cast<std::int16_t>(sum + v);
    } else {
      std::byte& target = out[layout.values + 64 * (t % 4) + 4 * j + i];
      target |= static_cast<std::byte>(t < 4 ? v : v << 4);
    }
  }
  if (layout.sums >= 0) std::memcpy(out + layout.sums + 2 * j, &sum, 2);
}

// Value k of row j of a group's block (the layout's inverse), with the row's d and m applied.
float interleaved_value(WeightFormat format, const std::byte* group_block, int j, int k) {
  const GroupBlockLayout layout = group_block_layout(format);
  const float d = stored_value(DType::dtype_f16, group_block + 2 * j);
  const int t = k / 4, i = k % 4;
  if (format == WeightFormat::q8_0)
    return d * static_cast<float>(
                   static_cast<std::int8_t>(group_block[layout.values + 64 * t + 4 * j + i]));
  const auto byte = std::to_integer<int>(group_block[layout.values + 64 * (t % 4) + 4 * j + i]);
  const int u = t < 4 ? byte & 0x0F : byte >> 4;
  if (format == WeightFormat::q4_0) return d * static_cast<float>(u - 8);
  return d * static_cast<float>(u) +
         stored_value(DType::dtype_f16, group_block + layout.minimums + 2 * j);
}

// x (M, K) rounded per block: q (M, K) int8 (+128 as unsigned bytes for Q8_0 weights on VNNI),
// and per (row, block) the scale dx and dx * sum(q).
struct QuantizedRows {
  std::vector<std::int8_t> q;
  std::vector<float> scale, scaled_sum;
  std::int64_t cols = 0, blocks = 0;
};

// One block of 32 values rounded to integers: the scale d = max|v| / 127 and the integers'
// sum, or a NaN scale (and integers 0) when a value is not finite, so that every output the block
// reaches is NaN, as in fp32, and the engine reports it. Q8_0 weights take the unsigned byte
// value + 128, kept in the same int8 storage.
void quantize_block(const float* v, bool unsigned_bytes, std::int8_t* q, float& d, int& sum) {
  float amax = 0;
  bool finite = true;
  for (int k = 0; k < kBlockValues; ++k) {
    amax = std::max(amax, std::fabs(v[k]));
    finite = finite && std::isfinite(v[k]);
  }
  d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float inverse = finite && d != 0 ? 1.0f / d : 0.0f;
  sum = 0;
  for (int k = 0; k < kBlockValues; ++k) {
    // (not NaN * 0 cast to int for a non-finite block: undefined behaviour, which clang's UBSan
    // reports)
    const int value = finite ? static_cast<int>(std::nearbyint(v[k] * inverse)) : 0;
    sum += value;
    q[k] = unsigned_bytes ? static_cast<std::int8_t>(static_cast<std::uint8_t>(value + 128))
                          : static_cast<std::int8_t>(value);
  }
}

#if KVLAB_Q8_VNNI || KVLAB_Q8_AVX2
// quantize_block's result for a block of finite values, 8 lanes at a time (the same maximum, the
// same product rounded to nearest even: the same integers); false, with nothing written, when a
// value is not finite.
bool quantize_finite_block_avx2(const float* v, bool unsigned_bytes, std::int8_t* q, float& d,
                                int& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), infinity = _mm256_set1_ps(HUGE_VALF);
  __m256 x[4], amax = _mm256_setzero_ps();
  int finite_lanes = 0xFF;
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 magnitude = _mm256_andnot_ps(sign, x[i]);
    finite_lanes &= _mm256_movemask_ps(_mm256_cmp_ps(magnitude, infinity, _CMP_LT_OQ));
    amax = _mm256_max_ps(amax, magnitude);
  }
  if (finite_lanes != 0xFF) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  d = _mm_cvtss_f32(m) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d != 0 ? 1.0f / d : 0.0f);
  __m256i n[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));  // MXCSR: nearest, ties to even
    total = _mm256_add_epi32(total, n[i]);
  }
  // Packed in 128-bit lanes: dwords n0[0:4] n1[0:4] n2[0:4] n3[0:4] | n0[4:8] n1[4:8] ...
  __m256i bytes =
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (unsigned_bytes) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  sum = _mm_cvtsi128_si32(s4);
  return true;
}
#endif

void quantize_rows(const RowMatrix& x, bool unsigned_bytes, QuantizedRows& out) {
  out.cols = x.cols();
  out.blocks = x.cols() / kBlockValues;
  out.q.resize(static_cast<std::size_t>(x.rows() * x.cols()));
  out.scale.resize(static_cast<std::size_t>(x.rows() * out.blocks));
  out.scaled_sum.resize(out.scale.size());
  parallel_for(
      x.rows(),
      [&](std::int64_t m) {
        for (std::int64_t b = 0; b < out.blocks; ++b) {
          const float* v = x.row(m).data() + b * kBlockValues;
          std::int8_t* q = out.q.data() + m * out.cols + b * kBlockValues;
          float d = 0;
          int sum = 0;
#if KVLAB_Q8_VNNI || KVLAB_Q8_AVX2
          if (!quantize_finite_block_avx2(v, unsigned_bytes, q, d, sum))
#endif
            quantize_block(v, unsigned_bytes, q, d, sum);
          out.scale[static_cast<std::size_t>(m * out.blocks + b)] = d;
          out.scaled_sum[static_cast<std::size_t>(m * out.blocks + b)] =
              d * static_cast<float>(sum);
        }
      },
      17);
}

#if !KVLAB_Q8_VNNI && !KVLAB_Q8_AVX2
void store_outputs(const float* values, std::int64_t count, bool accumulate, float* y) {
  for (std::int64_t j = 0; j < count; ++j) y[j] = accumulate ? y[j] + values[j] : values[j];
}

// The plain loops: one group against rows [m0, m0 + rows) of x.
void group_rows_plain(WeightFormat format, const std::byte* group, const QuantizedRows& x,
                      std::int64_t m0, std::int64_t rows, float* out /* (rows, 16) */) {
  const GroupBlockLayout layout = group_block_layout(format);
  std::fill(out, out + rows * kGroupRows, 0.0f);
  for (std::int64_t b = 0; b < x.blocks; ++b) {
    const std::byte* gb = group + b * layout.bytes;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xb = (m0 + r) * x.blocks + b;
      const std::int8_t* qx = x.q.data() + (m0 + r) * x.cols + b * kBlockValues;
      for (int j = 0; j < kGroupRows; ++j) {
        std::int32_t dot = 0;
        for (int k = 0; k < kBlockValues; ++k) {
          const int t = k / 4, i = k % 4;
          const auto byte = gb[layout.values + 64 * (t % 4) + 4 * j + i];
          if (format == WeightFormat::q8_0) {
            dot += static_cast<std::int8_t>(gb[layout.values + 64 * t + 4 * j + i]) * qx[k];
          } else {
            const auto u = std::to_integer<int>(t < 4 ? byte & std::byte{0x0F} : byte >> 4);
            dot += u * qx[k];
          }
        }
        const float d = stored_value(DType::dtype_f16, gb + 2 * j);
        float& o = out[r * kGroupRows + j];
        o = std::fma(static_cast<float>(dot), d * x.scale[static_cast<std::size_t>(xb)], o);
        if (format != WeightFormat::q8_0) {
          const float m = format == WeightFormat::q4_0
                              ? -8.0f * d
                              : stored_value(DType::dtype_f16, gb + layout.minimums + 2 * j);
          o = std::fma(m, x.scaled_sum[static_cast<std::size_t>(xb)], o);
        }
      }
    }
  }
}

#endif

// run(std::integral_constant<int, rows>) for `rows` in [1, Max]: a tile's row count as a
// template argument (its accumulators an array of registers).
template <int Max, typename Run>
void with_tile_rows(int rows, Run&& run) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_tile_rows<Max - 1>(rows, run);
  }
  run(std::integral_constant<int, Max>{});
}

#if KVLAB_Q8_VNNI
// Rows [m0, m0 + Rows) of x against one group: out row r = y + (m0 + r) * ldy, 16 outputs
// (`mask`: those that exist). Per block: the group's 8 value slices in registers (Q4: 4 loads
// and their nibbles split), then per row of x 8 vpdpbusd with 4 broadcast activation bytes
// each (two sums in flight), one conversion and one or two FMAs with the block's scales.
template <WeightFormat Format, int Rows>
void group_tile_vnni(const std::byte* group, const QuantizedRows& x, std::int64_t m0,
                     __mmask16 mask, bool accumulate, float* y, std::int64_t ldy) {
  constexpr GroupBlockLayout layout = group_block_layout(Format);
  __m512 acc[Rows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (std::int64_t b = 0; b < x.blocks; ++b) {
    const std::byte* gb = group + b * layout.bytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
    __m512 m = _mm512_setzero_ps();
    __m512i w[8], correction = _mm512_setzero_si512();
    if constexpr (Format == WeightFormat::q8_0) {
      for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(gb + layout.values + 64 * t);
      correction = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(gb + layout.sums))),
                                     7);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i packed = _mm512_loadu_si512(gb + layout.values + 64 * p);
        w[p] = _mm512_and_si512(packed, low_nibbles);
        w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
      m = Format == WeightFormat::q4_1
              ? _mm512_cvtph_ps(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + layout.minimums)))
              : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    }
#pragma GCC unroll 8  // every accumulator stays in a register
    for (int r = 0; r < Rows; ++r) {
      const std::int8_t* qx = x.q.data() + (m0 + r) * x.cols + b * kBlockValues;
      __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        std::int32_t four = 0;
        std::memcpy(&four, qx + 4 * t, 4);
        const __m512i a = _mm512_set1_epi32(four);
        sums[t % 2] = Format == WeightFormat::q8_0 ? _mm512_dpbusd_epi32(sums[t % 2], a, w[t])
                                                   : _mm512_dpbusd_epi32(sums[t % 2], w[t], a);
      }
      __m512i dot = _mm512_add_epi32(sums[0], sums[1]);
      if constexpr (Format == WeightFormat::q8_0) dot = _mm512_sub_epi32(dot, correction);
      const auto xb = static_cast<std::size_t>((m0 + r) * x.blocks + b);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.scale[xb])), acc[r]);
      if constexpr (Format != WeightFormat::q8_0)
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[xb]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    float* out = y + (m0 + r) * ldy;
    if (accumulate) acc[r] = _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, out));
    _mm512_mask_storeu_ps(out, mask, acc[r]);
  }
}

constexpr int kTileRows = 8;  // 8 accumulators + 8 value slices + temporaries: 32 registers

// Rows [m_begin, m_end) against one group's `count` outputs.
template <WeightFormat Format>
void group_product_simd(const std::byte* group, std::int64_t count, const QuantizedRows& x,
                        std::int64_t m_begin, std::int64_t m_end, bool accumulate, float* y,
                        std::int64_t ldy) {
  const auto mask = static_cast<__mmask16>((1u << count) - 1);
  for (std::int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows)
    with_tile_rows<kTileRows>(
        static_cast<int>(std::min<std::int64_t>(kTileRows, m_end - m0)), [&](auto rows) {
          group_tile_vnni<Format, rows.value>(group, x, m0, mask, accumulate, y, ldy);
        });
}

#endif

#if KVLAB_Q8_AVX2
// The outputs of a group that exist, as lane masks of its two halves of 8 (a matrix's last
// group is padded to 16 rows of zeros in the interleaved layout: its tiles compute them, and
// only the rows that exist are stored).
struct GroupMask {
  __m256i halves[2];
  explicit GroupMask(std::int64_t count) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2; ++h)
      halves[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - 8 * h)), lane);
  }
};

// A group tile's sums into rows [m0, m0 + Rows) of y, columns 0-15 (those `mask` keeps), added
// to what is there when accumulating.
template <int Rows>
void store_group_tile(__m256 (&acc)[2][Rows], std::int64_t m0, const GroupMask& mask,
                      bool accumulate, float* y, std::int64_t ldy) {
  for (int r = 0; r < Rows; ++r)
    for (int h = 0; h < 2; ++h) {
      float* out = y + (m0 + r) * ldy + 8 * h;
      if (accumulate) acc[h][r] = _mm256_add_ps(acc[h][r], _mm256_maskload_ps(out, mask.halves[h]));
      _mm256_maskstore_ps(out, mask.halves[h], acc[h][r]);
    }
}

// Q8_0, AVX2: rows [m0, m0 + Rows) of x against the 16 outputs of a group, as two halves of 8.
// Per block, slice by slice (32 bytes a half: 4 values of each of its 8 outputs), each row's 4
// activation bytes are broadcast once for both halves, given the signs of the weights
// (|v| . sign(qx, v): VNNI's unsigned side is the activations + 128 instead) and multiplied by
// vpmaddubsw; a pair of products is at most 2 x 128 x 127, so each slice's pairs widen at once
// (vpmaddwd). Slices outside, rows inside: with the 8 slices held in registers, AVX2's 16 had
// spilled the rows' sums every block.
template <int Rows>
void group_tile_q8_avx2(const std::byte* group, const QuantizedRows& x, std::int64_t m0,
                        const GroupMask& mask, bool accumulate, float* y, std::int64_t ldy) {
  constexpr GroupBlockLayout layout = group_block_layout(WeightFormat::q8_0);
  __m256 acc[2][Rows];
  for (auto& half : acc)
    for (auto& a : half) a = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (std::int64_t b = 0; b < x.blocks; ++b) {
    const std::byte* gb = group + b * layout.bytes;
    __m256i dot[2][Rows];
    for (auto& half : dot)
      for (auto& s : half) s = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC loaded every slice first and spilled them
    for (int t = 0; t < 8; ++t) {
      __m256i v[2], magnitude[2];
      for (int h = 0; h < 2; ++h) {
        v[h] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(gb + layout.values + 64 * t + 32 * h));
        magnitude[h] = _mm256_abs_epi8(v[h]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        std::int32_t four = 0;
        std::memcpy(&four, x.q.data() + (m0 + r) * x.cols + b * kBlockValues + 4 * t, 4);
        const __m256i a = _mm256_set1_epi32(four);
        for (int h = 0; h < 2; ++h)
          dot[h][r] = _mm256_add_epi32(
              dot[h][r], _mm256_madd_epi16(
                             _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(a, v[h])), ones));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16 * h)));
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const auto xb = static_cast<std::size_t>((m0 + r) * x.blocks + b);
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][r]),
                                    _mm256_mul_ps(d, _mm256_set1_ps(x.scale[xb])), acc[h][r]);
      }
    }
  }
  store_group_tile(acc, m0, mask, accumulate, y, ldy);
}

// Q4, AVX2: as group_tile_q8_avx2, one load holding two slices' nibbles (p and p + 4) per half.
// A pair of nibble products is at most 2 x 15 x 127 = 3,810, so a block's 8 slices sum in 16
// bits exactly (30,480) and widen once (llama.cpp's AVX2 Q4 dot does the same). Each row's
// broadcast serving both halves: ~125 vector operations per 1,024 products against ~140 for
// one half at a time (llvm-mca, Zen 3: the 4 vector pipes are the bound); 3 rows keep the 6
// sums and 4 weight registers in AVX2's 16.
template <WeightFormat Format, int Rows>
void group_tile_q4_avx2(const std::byte* group, const QuantizedRows& x, std::int64_t m0,
                        const GroupMask& mask, bool accumulate, float* y, std::int64_t ldy) {
  constexpr GroupBlockLayout layout = group_block_layout(Format);
  __m256 acc[2][Rows];
  for (auto& half : acc)
    for (auto& a : half) a = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const std::int8_t* rows[Rows];
  for (int r = 0; r < Rows; ++r) rows[r] = x.q.data() + (m0 + r) * x.cols;
  for (std::int64_t b = 0; b < x.blocks; ++b) {
    const std::byte* gb = group + b * layout.bytes;
    __m256i pairs[2][Rows];
    for (auto& half : pairs)
      for (auto& s : half) s = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC split every slice first and spilled them
    for (int p = 0; p < 4; ++p) {
      __m256i low[2], high[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(gb + layout.values + 64 * p + 32 * h));
        low[h] = _mm256_and_si256(packed, low_nibbles);
        high[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
      }
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        std::int32_t four[2];
        std::memcpy(&four[0], rows[r] + b * kBlockValues + 4 * p, 4);
        std::memcpy(&four[1], rows[r] + b * kBlockValues + 4 * (p + 4), 4);
        const __m256i a = _mm256_set1_epi32(four[0]), a4 = _mm256_set1_epi32(four[1]);
        for (int h = 0; h < 2; ++h)  // exact in 16 bits (above)
          pairs[h][r] = _mm256_add_epi16(
              pairs[h][r],
              _mm256_add_epi16(_mm256_maddubs_epi16(low[h], a), _mm256_maddubs_epi16(high[h], a4)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16 * h)));
      const __m256 m = Format == WeightFormat::q4_1
                           ? _mm256_cvtph_ps(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(gb + layout.minimums + 16 * h)))
                           : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const auto xb = static_cast<std::size_t>((m0 + r) * x.blocks + b);
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[h][r], ones)),
                                    _mm256_mul_ps(d, _mm256_set1_ps(x.scale[xb])), acc[h][r]);
        acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[xb]), acc[h][r]);
      }
    }
  }
  store_group_tile(acc, m0, mask, accumulate, y, ldy);
}

constexpr int kGroupTileRows = 3;

// Rows [m_begin, m_end) against one group's `count` outputs.
template <WeightFormat Format>
void group_product_simd(const std::byte* group, std::int64_t count, const QuantizedRows& x,
                        std::int64_t m_begin, std::int64_t m_end, bool accumulate, float* y,
                        std::int64_t ldy) {
  const GroupMask mask(count);
  for (std::int64_t m0 = m_begin; m0 < m_end; m0 += kGroupTileRows)
    with_tile_rows<kGroupTileRows>(
        static_cast<int>(std::min<std::int64_t>(kGroupTileRows, m_end - m0)), [&](auto rows) {
          if constexpr (Format == WeightFormat::q8_0)
            group_tile_q8_avx2<rows.value>(group, x, m0, mask, accumulate, y, ldy);
          else
            group_tile_q4_avx2<Format, rows.value>(group, x, m0, mask, accumulate, y, ldy);
        });
}
#endif

// Rows [m_begin, m_end) of x against group g: y's columns 16 g ... (fewer in the last group).
void group_product(WeightFormat format, const std::byte* group, std::int64_t g,
                   std::int64_t outputs, const QuantizedRows& x, std::int64_t m_begin,
                   std::int64_t m_end, bool accumulate, RowMatrix& y) {
  const std::int64_t n0 = g * kGroupRows, count = std::min(kGroupRows, outputs - n0);
#if KVLAB_Q8_VNNI || KVLAB_Q8_AVX2
  float* target = y.data() + n0;
  switch (format) {
    case WeightFormat::q8_0:
      return group_product_simd<WeightFormat::q8_0>(group, count, x, m_begin, m_end, accumulate,
                                                    target, y.cols());
    case WeightFormat::q4_0:
      return group_product_simd<WeightFormat::q4_0>(group, count, x, m_begin, m_end, accumulate,
                                                    target, y.cols());
    default:
      return group_product_simd<WeightFormat::q4_1>(group, count, x, m_begin, m_end, accumulate,
                                                    target, y.cols());
  }
#else
  float out[kGroupRows];
  for (std::int64_t m = m_begin; m < m_end; ++m) {
    group_rows_plain(format, group, x, m, 1, out);
    store_outputs(out, count, accumulate, y.data() + m * y.cols() + n0);
  }
#endif
}

}  // namespace

namespace q8 {

void dequantize_interleaved_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                                 float* out) {
  const GroupBlockLayout layout = group_block_layout(w.format());
  const std::int64_t blocks = w.cols() / kBlockValues;
  for (std::int64_t r = first; r < first + count; ++r) {
    const std::byte* group = w.data() + (r / kGroupRows) * blocks * layout.bytes;
    const int j = static_cast<int>(r % kGroupRows);
    for (std::int64_t b = 0; b < blocks; ++b)
      for (int k = 0; k < kBlockValues; ++k)
        *out++ = interleaved_value(w.format(), group + b * layout.bytes, j, k);
  }
}

void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows();
  const std::int64_t group_bytes = w.cols() / kBlockValues * group_block_layout(w.format()).bytes;
  thread_local QuantizedRows kept;  // between products: no allocation per call
  QuantizedRows& quantized = kept;  // the caller's, shared by the threads below
  quantize_rows(x, kUnsignedQ8Activations && w.format() == WeightFormat::q8_0, quantized);
  for_each_group_pass(rows, group_count(outputs),
                      [&](std::int64_t g, std::int64_t m_begin, std::int64_t m_end) {
                        group_product(w.format(), w.data() + g * group_bytes, g, outputs, quantized,
                                      m_begin, m_end, accumulate, y);
                      });
}

std::vector<std::byte> interleave(const WeightMatrix& w) {
  const GroupBlockLayout layout = group_block_layout(w.format());
  const std::int64_t blocks = w.cols() / kBlockValues;
  const std::int64_t block_bytes = weight_format_block_bytes(w.format());
  std::vector<std::byte> out(
      static_cast<std::size_t>(group_count(w.rows()) * blocks * layout.bytes));
  parallel_for(w.rows(), [&](std::int64_t r) {
    std::byte* group = out.data() + (r / kGroupRows) * blocks * layout.bytes;
    for (std::int64_t b = 0; b < blocks; ++b)
      pack_row_block(w.format(), w.row(r) + b * block_bytes, static_cast<int>(r % kGroupRows),
                     group + b * layout.bytes);
  });
  return out;
}

}  // namespace q8
}  // namespace kvlab::cpu
