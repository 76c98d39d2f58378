#pragma once
// The panel layout of f32/f16/bf16 weights multiplied with fp32 activations
// (WeightMatrix::packed_for, panel_matmul.cpp): the layout the register tiles of the product read,
// packed once at load so that no product transposes weights.
//
// Rows are taken 32 at a time (a panel; the last one padded with zero rows). A panel stores, for
// each column k in order, the 32 rows' values side by side in the matrix's format:
//   panel p, column k, row j  ->  element (p * cols + k) * 32 + j
// so a panel is (cols, 32): one row of it is 32 outputs' weights for one input value, which two
// 512-bit registers (fp32) hold. Panels follow one another: the matrix's bytes are a single
// stream, each thread's share of panels a few contiguous ranges of it.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvlab/cpu_reference/weight_matrix.hpp"  // first: it includes eigen_core.hpp
#include "kvlab/dtype.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvlab::cpu::panels {

constexpr std::int64_t kPanelRows = 32;

constexpr std::int64_t panel_count(std::int64_t rows) {
  return (rows + kPanelRows - 1) / kPanelRows;
}

// The DType of an f32/f16/bf16 matrix's values (their bytes: weight_format_block_bytes).
inline DType float_dtype(WeightFormat format) {
  return format == WeightFormat::f32   ? DType::dtype_f32
         : format == WeightFormat::f16 ? DType::dtype_f16
                                       : DType::dtype_bf16;
}

// x (M, K) as tiles of t = `tile_rows` rows, each (K, t): out[(m / t) * K * t + k * t + m % t]
// = x(m, k), the last tile's missing rows zero. A register tile's broadcasts then read
// consecutive floats (rows of x a multiple of 4 KiB apart would all fall in one L1 set).
// row_tile_count(M, t) tiles of K * t floats; pack_row_tile writes tile `tile` of them (the
// threads of a product share the tiles out).
#if defined(__AVX__)
// Columns [k, k + 8) of 8 rows, transposed in registers: out[c * out_stride + i] = rows[i][k + c];
// a null row reads as zeros. (Activation tiles and the Q kernels' widened weight panels.)
inline void transpose_8x8(const float* const* rows, std::int64_t k, float* out,
                          std::int64_t out_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = rows[i] ? _mm256_loadu_ps(rows[i] + k) : _mm256_setzero_ps();
  for (int i = 0; i < 8; i += 2) {  // pairs of rows: a0 b0 a1 b1 | a4 b4 a5 b5
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // pairs of pairs: a0 b0 c0 d0 | a4 b4 c4 d4, ...
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // the 128-bit halves: column c of rows 0-3 and 4-7, and c + 4
    _mm256_storeu_ps(out + c * out_stride, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(out + (c + 4) * out_stride, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#endif

inline std::int64_t row_tile_count(std::int64_t rows, int tile_rows) {
  return (rows + tile_rows - 1) / tile_rows;
}
void pack_row_tile(const RowMatrix& x, int tile_rows, std::int64_t tile, float* out);
// The rows of `w` (row-major f32, f16 or bf16) in the layout above.
std::vector<std::byte> pack(const WeightMatrix& w);
// Rows [first, first + count) of a panel matrix as fp32 (count, cols).
void dequantize_panel_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                           float* out);
// Rows of x in one register tile of multiply (8 with AVX-512, 6 with AVX2; 1 without): up to
// this many, the panels stream from memory through one tile; more, several tiles read each panel
// from cache.
int tile_rows();
// y (+)= x w^T, w in panels, x fp32. y sized by the caller.
void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate);

}  // namespace kvlab::cpu::panels
