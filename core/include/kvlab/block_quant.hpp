#pragma once
// llama.cpp's 32-value blocks (ggml-quants.c) from and to fp32: Q8_0 (fp16 scale + 32 int8),
// Q4_0 (fp16 scale + 16 bytes of nibbles), Q4_1 (fp16 scale and minimum + 16 bytes), Q5_0 (fp16
// scale, 4 bytes of fifth bits, 16 bytes of nibbles) and Q5_1 (fp16 scale and minimum, then the
// same). Value j < 16 is the low nibble of byte j, value j + 16 its high nibble; a Q5 value's
// fifth bit is bit j of the 32-bit little-endian qh. Weights rounded to a Q format, GGUF tensors
// read, and quantized KV rows (q8_0, q4_0, q4_1 pools) share them.
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvlab {

enum class BlockFormat : std::uint8_t { q8_0, q4_0, q4_1, q5_0, q5_1 };
inline constexpr std::size_t kBlockValues = 32;
std::size_t block_bytes(BlockFormat format);  // 34, 18, 20, 22, 24

// `source` (a multiple of 32 values) into whole blocks in `destination` (exactly their bytes),
// as quantize_row_*_ref; and back, as dequantize_row_*. Precondition: the sizes match.
void quantize_blocks(BlockFormat format, std::span<const float> source,
                     std::span<std::byte> destination);
void dequantize_blocks(BlockFormat format, std::span<const std::byte> source,
                       std::span<float> destination);

// Reading a block's fields: an fp16 scale (or minimum) as fp32, and one byte.
namespace block_field {
float f16(const std::byte* p);
inline std::uint8_t u8(const std::byte* p) {
  return std::to_integer<std::uint8_t>(*p);
}
}  // namespace block_field

}  // namespace kvlab
