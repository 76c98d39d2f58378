#pragma once
// The interleaved layouts of weights multiplied with reduced-precision activations
// (WeightMatrix::packed_for): Q8_0/Q4_0/Q4_1 with 8-bit activations (q8_matmul.cpp) and
// bf16 with bf16 activations (bf16_matmul.cpp). Each namespace packs, widens back and multiplies.
//
// q8:
// Rows are taken 16 at a time (a group; the last one padded with zero rows). For each group and
// each 32-value block, in this order (groups outer, blocks inner, so a group's bytes stream):
//   d[16]     f16 scales, one per row
//   m[16]     f16 minimums (Q4_1 only)
//   wsum[16]  int16 sums of the block's 32 values (Q8_0 only: the +128 activation offset's
//             correction)
//   values    8 slices of 64 bytes, slice t holding, for row j, values 4t..4t+3 at bytes
//             4j..4j+3: one 512-bit register per slice, whose 32-bit lanes are the 16 rows, so a
//             VNNI dot product of a slice with 4 broadcast activation bytes sums 4 values for
//             16 outputs at once. Q8_0: int8 values, 512 bytes. Q4_0/Q4_1: 4 slices of 64 bytes
//             (256 bytes), the low nibbles holding slices 0-3 and the high nibbles slices 4-7.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/dtype.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {

// One stored f16 or bf16 value (a scale, a minimum, a weight) as fp32.
inline float stored_value(DType dtype, const std::byte* p) {
  float value = 0;
  convert_to_f32(dtype, {p, 2}, {&value, 1});
  return value;
}

// The product of both layouts: the rows of x go in passes of 128 (their rounded copy stays in L2
// while each group's bytes are read once per pass), and the threads share the (pass, group of 16
// outputs) items of all passes in one loop, claimed in order: the thread ahead takes the next
// groups instead of waiting at a join. `group_product(g, m_begin, m_end)` does rows
// [m_begin, m_end) against group g.
template <typename GroupProduct>
void for_each_group_pass(std::int64_t rows, std::int64_t groups, GroupProduct&& group_product) {
  constexpr std::int64_t kRowsPerPass = 128;
  const std::int64_t passes = (rows + kRowsPerPass - 1) / kRowsPerPass;
  parallel_for(passes * groups, [&](std::int64_t item) {
    const std::int64_t m_begin = item / groups * kRowsPerPass;
    group_product(item % groups, m_begin, std::min(rows, m_begin + kRowsPerPass));
  });
}

}  // namespace kvlab::cpu

namespace kvlab::cpu::q8 {

constexpr std::int64_t kGroupRows = 16;
constexpr std::int64_t kBlockValues = 32;

struct GroupBlockLayout {
  std::int64_t minimums = -1;  // byte offset of m[16], -1 when absent
  std::int64_t sums = -1;      // byte offset of wsum[16], -1 when absent
  std::int64_t values = 0;     // byte offset of the value slices
  std::int64_t bytes = 0;      // of one group's block
};

constexpr GroupBlockLayout group_block_layout(WeightFormat format) {
  switch (format) {
    case WeightFormat::q8_0:
      return {-1, 32, 64, 64 + 512};
    case WeightFormat::q4_1:
      return {32, -1, 64, 64 + 256};
    default:  // q4_0
      return {-1, -1, 32, 32 + 256};
  }
}

constexpr std::int64_t group_count(std::int64_t rows) {
  return (rows + kGroupRows - 1) / kGroupRows;
}

// Rows [first, first + count) of an interleaved matrix widened to fp32 (count, cols).
void dequantize_interleaved_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                                 float* out);
// y (+)= x w^T, w interleaved, x rounded to 8-bit blocks first. y sized by the caller.
void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate);
// The rows of `w` (row-major Q8_0/Q4_0/Q4_1) in the layout above.
std::vector<std::byte> interleave(const WeightMatrix& w);

}  // namespace kvlab::cpu::q8

// bf16: rows taken 16 at a time (the last group padded with zero rows); a group stores, for each
// pair of values (k = 2p, 2p + 1), 64 bytes: row j's two bf16 values at bytes 4j..4j+3. One
// AVX-512 BF16 instruction (vdpbf16ps) multiplies such a slice with 2 broadcast activations and
// adds both products into 16 fp32 outputs. A group's pairs follow one another.
namespace kvlab::cpu::bf16 {

constexpr std::int64_t kGroupRows = 16;

constexpr std::int64_t group_count(std::int64_t rows) {
  return (rows + kGroupRows - 1) / kGroupRows;
}

void dequantize_interleaved_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                                 float* out);
// y (+)= x w^T, w interleaved, x rounded to bf16 (nearest even) first. y sized by the caller.
void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate);
std::vector<std::byte> interleave(const WeightMatrix& w);  // w: row-major bf16

}  // namespace kvlab::cpu::bf16
