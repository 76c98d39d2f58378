#pragma once
// KIVI's keys (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
// 2024): one head's keys quantized per channel over a group of 32 consecutive tokens, x = code x
// scale[d] + min[d], the group's min and max of channel d mapped to codes 0 and 2^bits - 1.
// Channels, not tokens, carry the outliers of K (a few channels are large in every token), so a
// per-channel scale spends the codes where the values spread.
//
// A sealed group: its 32 key rows (`stride` bytes apart, one head each) hold
//   [codes: head_dim x bits / 8 bytes][params share: head_dim / 8 bytes]
// with codes in blocks of 32 channels as int2 (bits 2: channel j of a block in byte j % 8 at bit
// 2 (j / 8)) or q4_1 (bits 4: j < 16 the low nibble of byte j, else the high one of byte j - 16)
// store them, and the group's params, head_dim fp16 scales then head_dim fp16 mins (4 x head_dim
// bytes), spread over the 32 rows in order: row r holds bytes [r x head_dim / 8, + head_dim / 8).
// A row is then as long as the value row of the same bits (int2 / q4_1), and every copy of whole
// groups (a swap, a tier move, a copy-on-write of a full block) carries the params with them.
#include <cstddef>
#include <cstdint>

#include "kvlab/dtype.hpp"

namespace kvlab {

constexpr std::int64_t kKiviGroup = 32;  // tokens per key group
// KIVI's residual length R, the paper's default: a sequence's newest R tokens stay in fp16. A
// group is sealed (quantized) once its last position is older than the sequence's newest R, so
// R to R + 31 of the newest tokens are fp16 (in whole groups of 32 rows), a multiple of 32.
constexpr std::int64_t kKiviResidualDefault = 128;
constexpr std::int64_t kKiviResidualMost = 1 << 20;  // bounds the open groups' bytes
// Whether R is a residual length a KIVI pool takes: a multiple of 32 in [0, kKiviResidualMost].
inline bool kivi_residual_valid(std::int64_t residual) {
  return residual >= 0 && residual % kKiviGroup == 0 && residual <= kKiviResidualMost;
}

// Groups of a sequence of `tokens` positions (from position 0) still open under residual R:
// ceil(tokens / 32) - max(0, floor((tokens - R) / 32)), at most R / 32 + 1.
std::int64_t kivi_open_groups(std::int64_t tokens, std::int64_t residual);
// The most groups a sequence keeps open under residual R: R / 32 + 1.
inline std::int64_t kivi_most_open_groups(std::int64_t residual) {
  return residual / kKiviGroup + 1;
}

// 2 (kivi2) or 4 (kivi4).
int kivi_bits(DType dtype);
// Bytes of a key row's codes (head_dim x bits / 8); its params share follows them.
inline std::int64_t kivi_code_bytes(int bits, std::int64_t head_dim) {
  return head_dim * bits / 8;
}

// Quantizes one head's group: keys (32, head_dim) fp32, row-major, into the 32 rows at `rows`.
// Codes are rounded against the stored fp16 scale and min; a channel with a non-finite value
// keeps codes 0.
void kivi_seal_key_group(int bits, const float* keys, std::int64_t head_dim, std::byte* rows,
                         std::int64_t stride);
// The group's per-channel scales and mins (head_dim each), read from the params of its 32 rows.
void kivi_key_params(int bits, const std::byte* rows, std::int64_t stride, std::int64_t head_dim,
                     float* scales, float* mins);
// Row r of a sealed group (r < 32) as head_dim floats, given its params.
void kivi_key_row_to_f32(int bits, const std::byte* row, std::int64_t head_dim, const float* scales,
                         const float* mins, float* out);

}  // namespace kvlab
