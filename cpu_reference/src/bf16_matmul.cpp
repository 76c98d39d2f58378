// y (+)= x w^T for bf16 weights in the interleaved layout (interleaved.hpp), with x rounded to
// bf16 first (llama.cpp's bf16 vec_dot type): with AVX-512 BF16, vdpbf16ps multiplies 16 rows'
// pairs of values by one broadcast pair of x and adds both products to 16 fp32 sums (twice the
// products of an fp32 FMA per instruction, and no widening). Register tiles of up to 8 rows of x
// share each slice of weights. Elsewhere the same products in plain loops.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVLAB_BF16_DOT 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "interleaved.hpp"
#include "kvlab/dtype.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

using bf16::group_count;
using bf16::kGroupRows;

// x (M, K) as bf16 bits, rounded to nearest even (convert_from_f32).
void round_rows(const RowMatrix& x, std::vector<std::uint16_t>& out) {
  out.resize(static_cast<std::size_t>(x.size()));
  convert_from_f32(DType::dtype_bf16, {x.data(), static_cast<std::size_t>(x.size())},
                   {reinterpret_cast<std::byte*>(out.data()), out.size() * 2});
}

#if KVLAB_BF16_DOT
// Rows [m0, m0 + Rows) of x against one group (16 outputs; `mask`: those that exist). Small
// tiles keep two sums per row so that one row does not wait on one chain of vdpbf16ps.
template <int Rows>
void group_tile(const std::byte* group, const std::uint16_t* x, std::int64_t depth, std::int64_t m0,
                __mmask16 mask, bool accumulate, float* y, std::int64_t ldy) {
  constexpr int kChains = Rows < 4 ? 2 : 1;
  __m512 acc[Rows][kChains];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const std::int64_t pairs = depth / 2;
  for (std::int64_t p = 0; p < pairs; p += kChains) {
#pragma GCC unroll 2
    for (int c = 0; c < kChains; ++c) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(group + 64 * (p + c));
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        std::int32_t two = 0;
        std::memcpy(&two, x + (m0 + r) * depth + 2 * (p + c), 4);
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, (__m512bh)_mm512_set1_epi32(two));
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    __m512 sum = acc[r][0];
    if constexpr (kChains == 2) sum = _mm512_add_ps(sum, acc[r][1]);
    float* out = y + (m0 + r) * ldy;
    if (accumulate) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, out));
    _mm512_mask_storeu_ps(out, mask, sum);
  }
}

constexpr int kGroupTileRows = 8;

template <int Rows = kGroupTileRows>
void group_tile_rows(int rows, const std::byte* group, const std::uint16_t* x, std::int64_t depth,
                     std::int64_t m0, __mmask16 mask, bool accumulate, float* y, std::int64_t ldy) {
  if constexpr (Rows > 1) {
    if (rows < Rows)
      return group_tile_rows<Rows - 1>(rows, group, x, depth, m0, mask, accumulate, y, ldy);
  }
  group_tile<Rows>(group, x, depth, m0, mask, accumulate, y, ldy);
}
#endif

// Rows [m_begin, m_end) of x against group g (y's columns 16 g ...).
void group_product(const std::byte* group, std::int64_t g, std::int64_t outputs,
                   const std::uint16_t* x, std::int64_t depth, std::int64_t m_begin,
                   std::int64_t m_end, bool accumulate, RowMatrix& y) {
  const std::int64_t n0 = g * kGroupRows, count = std::min(kGroupRows, outputs - n0);
#if KVLAB_BF16_DOT
  const auto mask = static_cast<__mmask16>((1u << count) - 1);
  for (std::int64_t m0 = m_begin; m0 < m_end; m0 += kGroupTileRows) {
    const int rows = static_cast<int>(std::min<std::int64_t>(kGroupTileRows, m_end - m0));
    group_tile_rows(rows, group, x, depth, m0, mask, accumulate, y.data() + n0, y.cols());
  }
#else
  for (std::int64_t m = m_begin; m < m_end; ++m)
    for (std::int64_t j = 0; j < count; ++j) {
      float sum = 0;
      for (std::int64_t p = 0; p < depth / 2; ++p)
        for (int i = 0; i < 2; ++i) {
          const auto* xv = reinterpret_cast<const std::byte*>(x + m * depth + 2 * p + i);
          sum += stored_value(DType::dtype_bf16, group + 64 * p + 4 * j + 2 * i) *
                 stored_value(DType::dtype_bf16, xv);
        }
      float& target = y(m, n0 + j);
      target = accumulate ? target + sum : sum;
    }
#endif
}

}  // namespace

namespace bf16 {

std::vector<std::byte> interleave(const WeightMatrix& w) {
  const std::int64_t depth = w.cols(), group_bytes = kGroupRows * depth * 2;
  std::vector<std::byte> out(static_cast<std::size_t>(group_count(w.rows()) * group_bytes));
  parallel_for(w.rows(), [&](std::int64_t r) {
    std::byte* group = out.data() + (r / kGroupRows) * group_bytes;
    const std::int64_t j = r % kGroupRows;
    for (std::int64_t p = 0; p < depth / 2; ++p)
      std::memcpy(group + 64 * p + 4 * j, w.row(r) + 4 * p, 4);
  });
  return out;
}

void dequantize_interleaved_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                                 float* out) {
  const std::int64_t depth = w.cols(), group_bytes = kGroupRows * depth * 2;
  for (std::int64_t r = first; r < first + count; ++r) {
    const std::byte* group = w.data() + (r / kGroupRows) * group_bytes;
    const std::int64_t j = r % kGroupRows;
    for (std::int64_t k = 0; k < depth; ++k)
      *out++ = stored_value(DType::dtype_bf16, group + 64 * (k / 2) + 4 * j + 2 * (k % 2));
  }
}

void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows(), depth = w.cols();
  const std::int64_t group_bytes = kGroupRows * depth * 2;
  thread_local std::vector<std::uint16_t> kept;  // between products: no allocation per call
  std::vector<std::uint16_t>& rounded = kept;    // the caller's, shared by the threads below
  round_rows(x, rounded);
  for_each_group_pass(rows, group_count(outputs),
                      [&](std::int64_t g, std::int64_t m_begin, std::int64_t m_end) {
                        group_product(w.data() + g * group_bytes, g, outputs, rounded.data(), depth,
                                      m_begin, m_end, accumulate, y);
                      });
}

}  // namespace bf16
}  // namespace kvlab::cpu
