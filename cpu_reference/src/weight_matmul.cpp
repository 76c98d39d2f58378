// y (+)= x w^T with w in any WeightFormat. Each thread takes panels of 16 rows of w, widens a
// panel to fp32 once (f32 rows are used in place) and multiplies every row of x with it in
// register tiles: x rows x 4 w rows of 8-wide fp32 FMA accumulators, summed across at the end.
// Weights are read from memory once per product whatever the batch, and never repacked.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_WEIGHT_SIMD 1
#include <immintrin.h>
#endif

#include <Eigen/Dense>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kvlab/cpu_reference/weight_matrix.hpp"

namespace kvlab::cpu {
namespace {

constexpr std::int64_t kPanelRows = 16;
// Above this many rows an f32 product goes to BLAS: its packed GEMM wins once the packing is
// spread over enough rows (measured in kvlab_bench_decode / bench_matmul).
constexpr std::int64_t kBlasRows = 64;

#if KVLAB_WEIGHT_SIMD
// x rows per register tile: AVX-512 machines have 32 vector registers (the ymm forms included),
// so a 4 x 4 tile (16 accumulators) fits; AVX2 has 16, so 2 x 4.
#if defined(__AVX512VL__)
constexpr int kTileRows = 4;
#else
constexpr int kTileRows = 2;
#endif

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

// The 32 values of one Q block, widened: q (as 8-bit integers in two 16-byte halves) * d (+ m).
void widen_q4(const std::byte* qs, __m256 d, __m256 m, bool centered, float* out) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i halves[2] = {_mm_and_si128(packed, mask),
                             _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
  const __m256i offset = _mm256_set1_epi32(centered ? 8 : 0);
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 2; ++g) {
      const __m128i bytes = g == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
      const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), offset);
      _mm256_storeu_ps(out + h * 16 + g * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m));
    }
}

void widen_row(WeightFormat format, const std::byte* row, std::int64_t cols, float* out) {
  switch (format) {
    case WeightFormat::f16:
      for (std::int64_t k = 0; k + 8 <= cols; k += 8)
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(row + 2 * k))));
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
        widen_q4(row + 2, _mm256_set1_ps(half_to_float(row)), _mm256_setzero_ps(), true,
                 out + 32 * b);
      return;
    case WeightFormat::q4_1:
      for (std::int64_t b = 0; b < cols / 32; ++b, row += 20)
        widen_q4(row + 4, _mm256_set1_ps(half_to_float(row)),
                 _mm256_set1_ps(half_to_float(row + 2)), false, out + 32 * b);
      return;
    case WeightFormat::f32:
      break;
  }
  // f16/bf16 columns past the last multiple of 8: one at a time.
  const std::int64_t done = cols / 8 * 8;
  if (done < cols) {
    std::vector<float> tail(static_cast<std::size_t>(cols));
    WeightMatrix::from_bytes(format, 1, cols, {row, static_cast<std::size_t>(cols * 2)})
        .dequantize_rows(0, 1, tail.data());
    std::copy(tail.begin() + done, tail.end(), out + done);
  }
}

// out[i][j] = x row i . w row j over k in [0, k_vec) (k_vec a multiple of 8).
template <int Rows, int Cols>
void tile(const float* x, std::int64_t ldx, const float* w, std::int64_t ldw, std::int64_t k_vec,
          float (&out)[Rows][Cols]) {
  __m256 acc[Rows][Cols];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < k_vec; k += 8) {
    __m256 wv[Cols];
    for (int j = 0; j < Cols; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < Rows; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < Cols; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < Cols; ++j) out[i][j] = horizontal_sum(acc[i][j]);
}
#endif

struct Product {
  const RowMatrix& x;  // (M, K)
  RowMatrix& y;        // (M, N)
  bool accumulate;

  void store(std::int64_t m, std::int64_t n, float value) const {
    y(m, n) = accumulate ? y(m, n) + value : value;
  }

  // y[m0 : m0+Rows, n0 : n0+Cols] from w rows `w` (fp32, leading dimension K).
  template <int Rows, int Cols>
  void block(std::int64_t m0, std::int64_t n0, const float* w) const {
    const std::int64_t depth = x.cols();
    float out[Rows][Cols] = {};
    std::int64_t k_vec = 0;
#if KVLAB_WEIGHT_SIMD
    k_vec = depth / 8 * 8;
    tile<Rows, Cols>(x.row(m0).data(), depth, w, depth, k_vec, out);
#endif
    for (int i = 0; i < Rows; ++i)
      for (int j = 0; j < Cols; ++j) {
        float value = out[i][j];
        for (std::int64_t k = k_vec; k < depth; ++k) value += x(m0 + i, k) * w[j * depth + k];
        store(m0 + i, n0 + j, value);
      }
  }

  // Every row of x against panel rows [n0, n0 + count), widened in `w`.
  void panel(std::int64_t n0, std::int64_t count, const float* w) const {
    constexpr int kRows =
#if KVLAB_WEIGHT_SIMD
        kTileRows;
#else
        1;
#endif
    const std::int64_t depth = x.cols(), rows = x.rows();
    for (std::int64_t m0 = 0; m0 < rows; m0 += kRows) {
      const bool full = m0 + kRows <= rows;
      std::int64_t j = 0;
      for (; j + 4 <= count; j += 4)
        full ? block<kRows, 4>(m0, n0 + j, w + j * depth) : edge_rows<4>(m0, n0 + j, w + j * depth);
      for (; j < count; ++j)
        full ? block<kRows, 1>(m0, n0 + j, w + j * depth) : edge_rows<1>(m0, n0 + j, w + j * depth);
    }
  }

  template <int Cols>
  void edge_rows(std::int64_t m0, std::int64_t n0, const float* w) const {
    for (std::int64_t m = m0; m < x.rows(); ++m) block<1, Cols>(m, n0, w);
  }
};


#if KVLAB_WEIGHT_SIMD
// Up to this many rows of x, Q and f16/bf16 weights are widened in registers and used at once
// (no panel written and read back): decode at small batches reads each weight byte once and
// spends a few instructions on it.
constexpr std::int64_t kFusedRows = 4;

// The 32 nibbles of a Q4 block as four vectors of 8 floats (values 0-15, not yet scaled).
void q4_nibbles(const std::byte* qs, __m256 (&q)[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
}

void q8_values(const std::byte* qs, __m256 (&q)[4]) {
  for (int g = 0; g < 4; ++g)
    q[g] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g))));
}

// One Q row against Rows rows of x: per block, sum_k q_k x_k in fp32 scaled by d, plus
// m * sum_k x_k (Q4_1's minimum; Q4_0 is the same with m = -8 d). block_sums: (Rows, blocks).
template <int Rows>
void q_row_dot(WeightFormat format, const std::byte* row, const float* x, std::int64_t ldx,
               const float* block_sums, std::int64_t blocks, float (&out)[Rows]) {
  __m256 acc[Rows];
  float offset[Rows] = {};
  for (auto& a : acc) a = _mm256_setzero_ps();
  const std::int64_t block_bytes = weight_format_block_bytes(format);
  for (std::int64_t b = 0; b < blocks; ++b, row += block_bytes) {
    __m256 q[4];
    const float d = half_to_float(row);
    float m = 0;
    if (format == WeightFormat::q8_0) {
      q8_values(row + 2, q);
    } else if (format == WeightFormat::q4_0) {
      q4_nibbles(row + 2, q);
      m = -8.0f * d;
    } else {
      q4_nibbles(row + 4, q);
      m = half_to_float(row + 2);
    }
    const __m256 scale = _mm256_set1_ps(d);
    for (int i = 0; i < Rows; ++i) {
      const float* xb = x + i * ldx + 32 * b;
      __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      for (int g = 1; g < 4; ++g) dot = _mm256_fmadd_ps(q[g], _mm256_loadu_ps(xb + 8 * g), dot);
      acc[i] = _mm256_fmadd_ps(dot, scale, acc[i]);
      offset[i] += m * block_sums[i * blocks + b];
    }
  }
  for (int i = 0; i < Rows; ++i) out[i] = horizontal_sum(acc[i]) + offset[i];
}

// One f16/bf16 row against Rows rows of x (depth a multiple of 8).
template <int Rows>
void half_row_dot(WeightFormat format, const std::byte* row, const float* x, std::int64_t ldx,
                  std::int64_t depth, float (&out)[Rows]) {
  __m256 acc[Rows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < depth; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
    const __m256 w = format == WeightFormat::f16
                         ? _mm256_cvtph_ps(h)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    for (int i = 0; i < Rows; ++i)
      acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i * ldx + k), acc[i]);
  }
  for (int i = 0; i < Rows; ++i) out[i] = horizontal_sum(acc[i]);
}

template <int Rows>
void fused_rows(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate,
                std::int64_t m0, const std::vector<float>& block_sums) {
  const std::int64_t depth = w.cols(), blocks = depth / 32;
  const bool q = w.format() != WeightFormat::f16 && w.format() != WeightFormat::bf16;
#pragma omp for schedule(static)
  for (std::int64_t n = 0; n < w.rows(); ++n) {
    float out[Rows];
    if (q)
      q_row_dot<Rows>(w.format(), w.row(n), x.row(m0).data(), depth,
                      block_sums.data() + m0 * blocks, blocks, out);
    else
      half_row_dot<Rows>(w.format(), w.row(n), x.row(m0).data(), depth, depth, out);
    for (int i = 0; i < Rows; ++i) y(m0 + i, n) = accumulate ? y(m0 + i, n) + out[i] : out[i];
  }
}

// True when the product ran here: few rows of x, weights in a format widened in registers.
bool multiply_fused(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), depth = w.cols();
  if (rows > kFusedRows || w.format() == WeightFormat::f32 || depth % 8 != 0) return false;
  std::vector<float> block_sums;  // (rows, blocks): sum of x over each 32-value block
  if (depth % 32 == 0) {
    block_sums.resize(static_cast<std::size_t>(rows * (depth / 32)));
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t b = 0; b < depth / 32; ++b)
        block_sums[static_cast<std::size_t>(i * (depth / 32) + b)] = x.row(i).segment(b * 32, 32).sum();
  }
#pragma omp parallel
  {
    switch (rows) {
      case 4: fused_rows<4>(x, w, y, accumulate, 0, block_sums); break;
      case 3: fused_rows<3>(x, w, y, accumulate, 0, block_sums); break;
      case 2: fused_rows<2>(x, w, y, accumulate, 0, block_sums); break;
      default: fused_rows<1>(x, w, y, accumulate, 0, block_sums); break;
    }
  }
  return true;
}
#endif

void widen_panel(const WeightMatrix& w, std::int64_t first, std::int64_t count, float* out) {
#if KVLAB_WEIGHT_SIMD
  for (std::int64_t r = 0; r < count; ++r)
    widen_row(w.format(), w.row(first + r), w.cols(), out + r * w.cols());
#else
  w.dequantize_rows(first, count, out);
#endif
}

}  // namespace

void multiply_by_transposed(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y,
                            bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows(), depth = w.cols();
  if (!accumulate) y.resize(rows, outputs);
  if (w.format() == WeightFormat::f32 && rows > kBlasRows) {
    const Eigen::Map<const RowMatrix> weights(reinterpret_cast<const float*>(w.row(0)), outputs,
                                              depth);
    if (accumulate)
      y.noalias() += x * weights.transpose();
    else
      y.noalias() = x * weights.transpose();
    return;
  }
#if KVLAB_WEIGHT_SIMD
  if (multiply_fused(x, w, y, accumulate)) return;
#endif
  const Product product{x, y, accumulate};
  const std::int64_t panels = (outputs + kPanelRows - 1) / kPanelRows;
#pragma omp parallel
  {
    thread_local std::vector<float> widened;  // kept between products: no allocation per call
    if (w.format() != WeightFormat::f32 &&
        widened.size() < static_cast<std::size_t>(kPanelRows * depth))
      widened.resize(static_cast<std::size_t>(kPanelRows * depth));
#pragma omp for schedule(static)
    for (std::int64_t p = 0; p < panels; ++p) {
      const std::int64_t n0 = p * kPanelRows, count = std::min(kPanelRows, outputs - n0);
      const float* panel = reinterpret_cast<const float*>(w.row(n0));
      if (w.format() != WeightFormat::f32) {
        widen_panel(w, n0, count, widened.data());
        panel = widened.data();
      }
      product.panel(n0, count, panel);
    }
  }
}

}  // namespace kvlab::cpu
