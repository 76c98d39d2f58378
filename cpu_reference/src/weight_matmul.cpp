// y (+)= x w^T: the kernel for w's layout (panels: panel_matmul.cpp; interleaved: q8_matmul.cpp,
// bf16_matmul.cpp) or, for w row by row (Q formats with fp32 activations, and any matrix not
// packed for its products), in three ways by the rows of x (AVX2 + FMA + F16C):
//   up to 8 rows    (4 for f32/f16/bf16 rows) each thread streams w row by row, widening it in
//                   registers (fused_rows); each row of x gets the bits it would get alone;
//   more rows       each thread packs 32 (AVX-512) or 16 rows of w, widened, into a
//                   (depth, 32 or 16) panel in cache and multiplies x, packed in tiles of 8 or 6
//                   rows, with it (multiply_packed);
//   no AVX2, or depths that are not multiples of 8: Eigen dot products over dequantized
//                   panels (multiply_plain).
// Weights are read from memory once per product whatever the batch; with fp32 activations the
// math is fp32 on the dequantized values throughout.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_WEIGHT_SIMD 1
#include <immintrin.h>
#endif

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "interleaved.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "panels.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

constexpr std::int64_t kPanelRows = 16;

#if KVLAB_WEIGHT_SIMD
float horizontal_sum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1)));
}

float half_to_float(const std::byte* p) {
  std::uint16_t bits = 0;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

std::uint32_t fifth_bits(const std::byte* qh) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, qh, 4);  // little-endian, as the file and x86-64 are
  return bits;
}

// 8 lanes of 16 where bit 8 group + i of a Q5 block's qh is set (value 8 group + i's fifth bit),
// 0 elsewhere.
__m256i q5_high(std::uint32_t qh, int group) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set =
      _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(qh >> (8 * group))), bits);
  return _mm256_and_si256(_mm256_cmpeq_epi32(set, bits), _mm256_set1_epi32(16));
}

// The 32 values of one Q4/Q5 block, widened: (nibble (+ 16 fifth bit) - offset) * d + m. The
// nibbles as 8-bit integers in two 16-byte halves: values 8 group .. 8 group + 7 are bytes
// 8 (group % 2) .. of the low (group < 2) or high halves.
void widen_nibbles(const std::byte* qs, std::uint32_t qh, __m256 d, __m256 m, int offset,
                   float* out) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i halves[2] = {_mm_and_si128(packed, mask),
                             _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
  for (int group = 0; group < 4; ++group) {
    const __m128i half = halves[group / 2];
    const __m128i bytes = group % 2 == 0 ? half : _mm_srli_si128(half, 8);
    const __m256i q =
        _mm256_sub_epi32(_mm256_add_epi32(_mm256_cvtepu8_epi32(bytes), q5_high(qh, group)),
                         _mm256_set1_epi32(offset));
    _mm256_storeu_ps(out + 8 * group, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m));
  }
}

void widen_row(WeightFormat format, const std::byte* row, std::int64_t cols, float* out) {
  switch (format) {
    case WeightFormat::f16:
      for (std::int64_t k = 0; k + 8 <= cols; k += 8)
        _mm256_storeu_ps(
            out + k,
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
      break;
    case WeightFormat::bf16:
      for (std::int64_t k = 0; k + 8 <= cols; k += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
        _mm256_storeu_ps(out + k,
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
      break;
    case WeightFormat::q8_0:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 34) {
        const __m256 d = _mm256_set1_ps(half_to_float(row));
        for (int g = 0; g < 4; ++g) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * g));
          _mm256_storeu_ps(out + 32 * b + 8 * g,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
      }
      return;
    case WeightFormat::q4_0:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 18)
        widen_nibbles(row + 2, 0, _mm256_set1_ps(half_to_float(row)), _mm256_setzero_ps(), 8,
                      out + 32 * b);
      return;
    case WeightFormat::q4_1:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 20)
        widen_nibbles(row + 4, 0, _mm256_set1_ps(half_to_float(row)),
                      _mm256_set1_ps(half_to_float(row + 2)), 0, out + 32 * b);
      return;
    case WeightFormat::q5_0:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 22)
        widen_nibbles(row + 6, fifth_bits(row + 2), _mm256_set1_ps(half_to_float(row)),
                      _mm256_setzero_ps(), 16, out + 32 * b);
      return;
    case WeightFormat::q5_1:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 24)
        widen_nibbles(row + 8, fifth_bits(row + 4), _mm256_set1_ps(half_to_float(row)),
                      _mm256_set1_ps(half_to_float(row + 2)), 0, out + 32 * b);
      return;
    case WeightFormat::f32:
      break;
  }
}

#endif

#if KVLAB_WEIGHT_SIMD
// Up to this many rows of x, each weight row is widened in registers and used at once (no
// panel written and read back): decode at small batches streams each weight byte once, one
// row at a time, and spends a few instructions on it. Q rows take up to 8 rows of x (a decode
// and its speculative proposals: one accumulator each); f32/f16/bf16 rows up to 4 (two each).
constexpr std::int64_t kFusedRows = 8;
constexpr std::int64_t kFusedFloatRows = 4;

bool q_format(WeightFormat format) {
  return weight_format_block_values(format) == 32;
}

// Where a Q block's codes start (after the scale, the minimum and Q5's fifth bits), and its
// minimum m: x = q d + m for codes q read as unsigned (Q4_0: m = -8 d, Q5_0: -16 d; Q8_0's
// codes are signed, m = 0).
std::int64_t codes_at(WeightFormat format) {
  switch (format) {
    case WeightFormat::q4_1:
      return 4;
    case WeightFormat::q5_0:
      return 6;
    case WeightFormat::q5_1:
      return 8;
    default:
      return 2;
  }
}
float block_minimum(WeightFormat format, const std::byte* block, float d) {
  switch (format) {
    case WeightFormat::q4_0:
      return -8.0f * d;
    case WeightFormat::q5_0:
      return -16.0f * d;
    case WeightFormat::q4_1:
    case WeightFormat::q5_1:
      return half_to_float(block + 2);
    default:
      return 0.0f;
  }
}
// A Q5 block's fifth bits (0 for the other formats).
std::uint32_t block_fifth_bits(WeightFormat format, const std::byte* block) {
  if (format == WeightFormat::q5_0) return fifth_bits(block + 2);
  if (format == WeightFormat::q5_1) return fifth_bits(block + 4);
  return 0;
}

std::int64_t fused_row_limit(WeightFormat format) {
  return q_format(format) ? kFusedRows : kFusedFloatRows;
}

#if !defined(__AVX512F__)
// The 32 nibbles of a Q4 block as four vectors of 8 floats (values 0-15, not yet scaled); a Q5
// block's with their fifth bits (qh: values 0-31).
// The 16 bytes in both 128-bit lanes, then one byte shuffle spreads 8 of them over 8 dwords
// (bytes 0-3 in the low lane, 4-7 in the high): the dword holds the byte alone, so its low
// nibble is an AND away and its high nibble a shift. Two shuffles in all, where widening each
// half of the split nibbles took six (the shuffle pipes, not the FMAs, bounded a row).
void q4_nibbles(const std::byte* qs, __m256i (&spread)[2]) {
  const __m256i packed =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  constexpr char z = -1;  // a zero byte
  spread[0] = _mm256_shuffle_epi8(
      packed, _mm256_setr_epi8(0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z,  //
                               4, z, z, z, 5, z, z, z, 6, z, z, z, 7, z, z, z));
  spread[1] = _mm256_shuffle_epi8(
      packed, _mm256_setr_epi8(8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z,  //
                               12, z, z, z, 13, z, z, z, 14, z, z, z, 15, z, z, z));
}
void q4_nibbles(const std::byte* qs, __m256 (&q)[4]) {
  __m256i spread[2];
  q4_nibbles(qs, spread);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(spread[0], mask));  // values 0-7
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(spread[1], mask));  // 8-15
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(spread[0], 4));    // 16-23
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(spread[1], 4));    // 24-31
}
void q5_codes(const std::byte* qs, std::uint32_t qh, __m256 (&q)[4]) {
  q4_nibbles(qs, q);
  for (int g = 0; g < 4; ++g) q[g] = _mm256_add_ps(q[g], _mm256_cvtepi32_ps(q5_high(qh, g)));
}

void q8_values(const std::byte* qs, __m256 (&q)[4]) {
  for (int g = 0; g < 4; ++g)
    q[g] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g))));
}
#endif

#if defined(__AVX512F__)
// The 32 values of a Q block as two vectors of 16 floats (Q4: the nibbles 0-15, Q5 with their
// fifth bits from qh: 0-31; not yet scaled).
void q_values16(WeightFormat format, const std::byte* qs, std::uint32_t qh, __m512 (&q)[2]) {
  if (format == WeightFormat::q8_0) {
    for (int h = 0; h < 2; ++h)
      q[h] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h))));
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __m128i halves[2] = {_mm_and_si128(packed, mask),
                             _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
  for (int h = 0; h < 2; ++h)
    q[h] = _mm512_cvtepi32_ps(_mm512_mask_add_epi32(_mm512_cvtepu8_epi32(halves[h]),
                                                    static_cast<__mmask16>(qh >> (16 * h)),
                                                    _mm512_cvtepu8_epi32(halves[h]), sixteen));
}
#endif

// One Q row against Rows rows of x: per block, sum_k q_k x_k in fp32 scaled by d, plus
// m * sum_k x_k (block_minimum: Q4_1's and Q5_1's stored, -8 d or -16 d for Q4_0 and Q5_0).
// block_sums: (Rows, blocks).
// Each row of x gets the same operations in the same order whatever Rows is, so a verify entry's
// k + 1 rows get the bits that each would get alone (a speculative verify equals decoding).
// With AVX-512, 16-wide: half the multiplies per row of x, which is what the extra rows cost.
template <WeightFormat Format, int Rows>
void q_row_dot(const std::byte* row, const float* x, std::int64_t ldx, const float* block_sums,
               std::int64_t blocks, float (&out)[Rows]) {
#if defined(__AVX512F__)
  __m512 acc[Rows];
  for (auto& a : acc) a = _mm512_setzero_ps();
#else
  __m256 acc[Rows];
  for (auto& a : acc) a = _mm256_setzero_ps();
#endif
  float offset[Rows] = {};
  const std::int64_t block_bytes = weight_format_block_bytes(Format);
  const std::int64_t values_at = codes_at(Format);
  for (std::int64_t b = 0; b < blocks; ++b, row += block_bytes) {
    const float d = half_to_float(row);
    const float m = block_minimum(Format, row, d);
#if defined(__AVX512F__)
    __m512 q[2];
    q_values16(Format, row + values_at, block_fifth_bits(Format, row), q);
    const __m512 scale = _mm512_set1_ps(d);
    for (int i = 0; i < Rows; ++i) {
      const float* xb = x + i * ldx + 32 * b;
      const __m512 dot =
          _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(xb)));
      acc[i] = _mm512_fmadd_ps(dot, scale, acc[i]);
      offset[i] = std::fma(m, block_sums[i * blocks + b], offset[i]);  // not left to -ffp-contract
    }
#else
    __m256 q[4];
    if constexpr (Format == WeightFormat::q8_0)
      q8_values(row + values_at, q);
    else if constexpr (Format == WeightFormat::q5_0 || Format == WeightFormat::q5_1)
      q5_codes(row + values_at, block_fifth_bits(Format, row), q);
    else
      q4_nibbles(row + values_at, q);
    const __m256 scale = _mm256_set1_ps(d);
    for (int i = 0; i < Rows; ++i) {
      const float* xb = x + i * ldx + 32 * b;
      __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      for (int g = 1; g < 4; ++g) dot = _mm256_fmadd_ps(q[g], _mm256_loadu_ps(xb + 8 * g), dot);
      acc[i] = _mm256_fmadd_ps(dot, scale, acc[i]);
      offset[i] = std::fma(m, block_sums[i * blocks + b], offset[i]);  // not left to -ffp-contract
    }
#endif
  }
#if defined(__AVX512F__)
  for (int i = 0; i < Rows; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + offset[i];
#else
  for (int i = 0; i < Rows; ++i) out[i] = horizontal_sum(acc[i]) + offset[i];
#endif
}

// q_row_dot for `format`'s blocks, the format a constant of the loop (no branch per block).
template <int Rows>
void q_row_dot(WeightFormat format, const std::byte* row, const float* x, std::int64_t ldx,
               const float* block_sums, std::int64_t blocks, float (&out)[Rows]) {
  switch (format) {
    case WeightFormat::q8_0:
      return q_row_dot<WeightFormat::q8_0, Rows>(row, x, ldx, block_sums, blocks, out);
    case WeightFormat::q4_0:
      return q_row_dot<WeightFormat::q4_0, Rows>(row, x, ldx, block_sums, blocks, out);
    case WeightFormat::q4_1:
      return q_row_dot<WeightFormat::q4_1, Rows>(row, x, ldx, block_sums, blocks, out);
    case WeightFormat::q5_0:
      return q_row_dot<WeightFormat::q5_0, Rows>(row, x, ldx, block_sums, blocks, out);
    default:
      return q_row_dot<WeightFormat::q5_1, Rows>(row, x, ldx, block_sums, blocks, out);
  }
}

// 8 values of an f32/f16/bf16 row from value k, as fp32.
__m256 load8(WeightFormat format, const std::byte* row, std::int64_t k) {
  if (format == WeightFormat::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
  return format == WeightFormat::f16
             ? _mm256_cvtph_ps(h)
             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One f32/f16/bf16 row against Rows rows of x (depth a multiple of 16): two accumulators per row
// of x, so that a single row does not wait on one FMA chain.
template <int Rows>
void float_row_dot(WeightFormat format, const std::byte* row, const float* x, std::int64_t ldx,
                   std::int64_t depth, float (&out)[Rows]) {
  __m256 acc[Rows][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < depth; k += 16) {
    const __m256 w0 = load8(format, row, k), w1 = load8(format, row, k + 8);
    for (int i = 0; i < Rows; ++i) {
      acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * ldx + k + 8), acc[i][1]);
    }
  }
  for (int i = 0; i < Rows; ++i) out[i] = horizontal_sum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

template <int Rows>
void fused_rows(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate,
                std::int64_t m0, const std::vector<float>& block_sums) {
  const std::int64_t depth = w.cols(), blocks = depth / 32;
  const bool q = q_format(w.format());
  shared_loop(w.rows(), [&](std::int64_t n) {
    float out[Rows];
    if (q)
      q_row_dot<Rows>(w.format(), w.row(n), x.row(m0).data(), depth,
                      block_sums.data() + m0 * blocks, blocks, out);
    else
      float_row_dot<Rows>(w.format(), w.row(n), x.row(m0).data(), depth, depth, out);
    for (int i = 0; i < Rows; ++i) y(m0 + i, n) = accumulate ? y(m0 + i, n) + out[i] : out[i];
  });
}

// fused_rows<rows> (rows <= Rows): Rows counts down to the one needed.
template <int Rows>
void fused_rows_up_to(int rows, const RowMatrix& x, const WeightMatrix& w, RowMatrix& y,
                      bool accumulate, const std::vector<float>& block_sums) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return fused_rows_up_to<Rows - 1>(rows, x, w, y, accumulate, block_sums);
  }
  fused_rows<Rows>(x, w, y, accumulate, 0, block_sums);
}

// True when the product ran here: few rows of x, weights in a format widened in registers.
bool multiply_fused(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), depth = w.cols();
  if (rows > fused_row_limit(w.format()) || depth % 16 != 0) return false;
  std::vector<float> block_sums;  // (rows, blocks): sum of x over each 32-value block (Q only)
  if (weight_format_block_values(w.format()) == 32) {
    block_sums.resize(static_cast<std::size_t>(rows * (depth / 32)));
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t b = 0; b < depth / 32; ++b)
        block_sums[static_cast<std::size_t>(i * (depth / 32) + b)] =
            x.row(i).segment(b * 32, 32).sum();
  }
  parallel_region([&] {
    fused_rows_up_to<kFusedRows>(static_cast<int>(rows), x, w, y, accumulate, block_sums);
  });
  return true;
}
#endif

#if KVLAB_WEIGHT_SIMD
// More rows of x: each thread widens kPackWidth rows of w into a (depth, kPackWidth) panel —
// panel[k][j] = w(n0 + j, k) — and multiplies it with register tiles of kPackedRows rows of x:
// per k, two loads of the panel, one broadcast per x row, two FMAs per x row (no sums across
// lanes).
#if defined(__AVX512F__) && defined(__AVX512VL__)
// AVX-512: panels of 32 outputs in two 16-wide registers, tiles of 8 rows (16 accumulators of
// its 32 registers); half the instructions of 8-wide FMAs for the same work.
constexpr std::int64_t kPackWidth = 32;
constexpr int kPackedRows = 8;
#else
constexpr std::int64_t kPackWidth = 16;
constexpr int kPackedRows = 6;  // 12 accumulators: AVX2's 16
#endif

// Rows [n0, n0 + count) of w (count <= 16; depth a multiple of 8) as the (depth, 16) panel,
// zero past count. Q/f16/bf16 rows are widened into `rows_buffer` first (rows 16 floats longer
// than depth, so that they do not all fall in one L1 set).
void pack_panel(const WeightMatrix& w, std::int64_t n0, std::int64_t count, float* rows_buffer,
                float* panel) {
  const std::int64_t depth = w.cols();
  const float* rows = reinterpret_cast<const float*>(w.row(n0));
  std::int64_t stride = depth;
  // f32 rows a multiple of 4 KiB apart would all fall in one L1 set while 8 are transposed at
  // once: copied to the padded buffer first, like the widened formats.
  if (w.format() != WeightFormat::f32 || count < kPackWidth || (depth * 4) % 4096 == 0) {
    stride = depth + 16;
    for (std::int64_t r = 0; r < kPackWidth; ++r) {
      float* row = rows_buffer + r * stride;
      if (r >= count)
        std::fill(row, row + depth, 0.0f);
      else if (w.format() == WeightFormat::f32)
        std::copy_n(reinterpret_cast<const float*>(w.row(n0 + r)), depth, row);
      else
        widen_row(w.format(), w.row(n0 + r), depth, row);
    }
    rows = rows_buffer;
  }
  const float* row_of[kPackWidth];
  for (std::int64_t r = 0; r < kPackWidth; ++r) row_of[r] = rows + r * stride;
  for (std::int64_t k = 0; k < depth; k += 8)
    for (std::int64_t r0 = 0; r0 < kPackWidth; r0 += 8)
      panels::transpose_8x8(row_of + r0, k, panel + k * kPackWidth + r0, kPackWidth);
}

// out (Rows, 16) = x tile . panel (depth, 16); the x tile is packed (depth, kPackedRows):
// x[k * kPackedRows + i] is row i's value k, so its broadcasts read consecutive floats (rows of
// x a multiple of 4 KiB apart would all fall in one L1 set).
template <int Rows>
void packed_tile(const float* x, const float* panel, std::int64_t depth, float* out) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  __m512 acc[Rows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (std::int64_t k = 0; k < depth; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPackWidth);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPackWidth + 16);
    for (int i = 0; i < Rows; ++i) {
      const __m512 xi = _mm512_set1_ps(x[k * kPackedRows + i]);
      acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < Rows; ++i) {
    _mm512_storeu_ps(out + i * kPackWidth, acc[i][0]);
    _mm512_storeu_ps(out + i * kPackWidth + 16, acc[i][1]);
  }
#else
  __m256 acc[Rows][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < depth; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPackWidth);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPackWidth + 8);
    for (int i = 0; i < Rows; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + k * kPackedRows + i);
      acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < Rows; ++i) {
    _mm256_storeu_ps(out + i * kPackWidth, acc[i][0]);
    _mm256_storeu_ps(out + i * kPackWidth + 8, acc[i][1]);
  }
#endif
}

// The tile for the last rows (fewer than kPackedRows): Rows counts down to the one needed.
template <int Rows>
void packed_tile_rows(int rows, const float* x, const float* panel, std::int64_t depth,
                      float* out) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return packed_tile_rows<Rows - 1>(rows, x, panel, depth, out);
  }
  packed_tile<Rows>(x, panel, depth, out);
}

void multiply_packed(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows(), depth = w.cols();
  const std::int64_t panels = (outputs + kPackWidth - 1) / kPackWidth;
  thread_local std::vector<float> kept;  // between products: no allocation per call
  std::vector<float>& x_tiles = kept;    // the caller's, shared by the threads below
  const std::int64_t tiles = panels::row_tile_count(rows, kPackedRows);
  x_tiles.resize(static_cast<std::size_t>(tiles * kPackedRows * depth));
  parallel_region([&] {
    shared_loop(tiles,
                [&](std::int64_t t) { panels::pack_row_tile(x, kPackedRows, t, x_tiles.data()); });
    thread_local std::vector<float> rows_buffer, panel;  // kept between products
    const auto size = static_cast<std::size_t>(kPackWidth * (depth + 16));
    if (rows_buffer.size() < size) rows_buffer.resize(size);
    if (panel.size() < size) panel.resize(size);
    shared_loop(panels, [&](std::int64_t p) {
      const std::int64_t n0 = p * kPackWidth, count = std::min(kPackWidth, outputs - n0);
      pack_panel(w, n0, count, rows_buffer.data(), panel.data());
      // The next panel's weight rows (most often this thread's: panels are claimed in runs) are
      // asked for in slices while the tiles compute, so that packing it does not wait on memory.
      const std::int64_t next = std::min(outputs, n0 + kPackWidth);
      const std::int64_t next_bytes = std::min(kPackWidth, outputs - next) * w.row_bytes();
      const std::int64_t slice = (next_bytes + tiles - 1) / tiles;
      for (std::int64_t m0 = 0; m0 < rows; m0 += kPackedRows) {
        const std::int64_t begin = std::min(next_bytes, m0 / kPackedRows * slice);
        const std::byte* ahead = next < outputs ? w.row(next) + begin : nullptr;
        for (std::int64_t b = 0; ahead && b < std::min(slice, next_bytes - begin); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
        const int tile_rows = static_cast<int>(std::min<std::int64_t>(kPackedRows, rows - m0));
        float out[kPackedRows * kPackWidth];
        packed_tile_rows<kPackedRows>(tile_rows, x_tiles.data() + m0 * depth, panel.data(), depth,
                                      out);
        for (int i = 0; i < tile_rows; ++i)
          for (std::int64_t j = 0; j < count; ++j) {
            float& target = y(m0 + i, n0 + j);
            target = accumulate ? target + out[i * kPackWidth + j] : out[i * kPackWidth + j];
          }
      }
    });
  });
}
#endif

// The plain path (no AVX2, or depths the kernels above do not take): each thread dequantizes a
// panel of rows (f32 rows are used in place) and takes Eigen's dot products of x with them.
void multiply_plain(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t outputs = w.rows(), depth = w.cols();
  const std::int64_t panels = (outputs + kPanelRows - 1) / kPanelRows;
  parallel_region([&] {
    thread_local std::vector<float> widened;  // kept between products: no allocation per call
    if (w.format() != WeightFormat::f32 &&
        widened.size() < static_cast<std::size_t>(kPanelRows * depth))
      widened.resize(static_cast<std::size_t>(kPanelRows * depth));
    shared_loop(panels, [&](std::int64_t p) {
      const std::int64_t n0 = p * kPanelRows, count = std::min(kPanelRows, outputs - n0);
      const float* panel = reinterpret_cast<const float*>(w.row(n0));
      if (w.format() != WeightFormat::f32) {
        w.dequantize_rows(n0, count, widened.data());
        panel = widened.data();
      }
      const Eigen::Map<const RowMatrix> rows(panel, count, depth);  // (count, depth)
      for (std::int64_t m = 0; m < x.rows(); ++m)
        for (std::int64_t j = 0; j < count; ++j) {
          const float dot = x.row(m).dot(rows.row(j));
          y(m, n0 + j) = accumulate ? y(m, n0 + j) + dot : dot;
        }
    });
  });
}

}  // namespace

std::vector<std::int64_t> gemm_kernel_switch_rows([[maybe_unused]] WeightFormat format) {
  std::vector<std::int64_t> rows;
#if KVLAB_WEIGHT_SIMD
  if (format == WeightFormat::f32 || format == WeightFormat::f16 || format == WeightFormat::bf16)
    rows.push_back(panels::tile_rows() + 1);  // one tile streaming the panels -> tiles from cache
  else
    rows.push_back(kFusedRows + 1);  // fused dot products -> packed panels
#endif
  return rows;
}

void multiply_by_transposed(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y,
                            bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows();
  if (!accumulate) y.resize(rows, outputs);
  if (rows == 0 || outputs == 0) return;  // nothing to sum (the kernels assume a row of x)
  if (w.layout() == WeightLayout::panels) return panels::multiply(x, w, y, accumulate);
  if (w.interleaved() && w.format() == WeightFormat::bf16)
    return bf16::multiply(x, w, y, accumulate);
  if (w.interleaved()) return q8::multiply(x, w, y, accumulate);
#if KVLAB_WEIGHT_SIMD
  if (multiply_fused(x, w, y, accumulate)) return;
  if (rows > fused_row_limit(w.format()) && w.cols() % 8 == 0)
    return multiply_packed(x, w, y, accumulate);
#endif
  multiply_plain(x, w, y, accumulate);
}

}  // namespace kvlab::cpu
