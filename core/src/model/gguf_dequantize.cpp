// Dequantization of the GGUF tensor types kvlab reads, block by block, as llama.cpp's
// dequantize_row_* (ggml-quants.c) computes it. Block layouts (little-endian, packed):
//   Q4_0  32 values: f16 d, u8 qs[16]            x = (nibble - 8) d   (low nibbles: 0-15,
//                                                                      high nibbles: 16-31)
//   Q4_1  32 values: f16 d, f16 m, u8 qs[16]     x = nibble d + m
//   Q5_0  32 values: f16 d, u32 qh, u8 qs[16]    x = (nibble | bit of qh << 4 - 16) d
//   Q5_1  32 values: f16 d, f16 m, u32 qh, u8 qs[16]  x = (nibble | bit of qh << 4) d + m
//                    (value j: low nibble of qs[j], qh bit j; value j + 16: high nibble, bit
//                    j + 16)
//   Q8_0  32 values: f16 d, i8 qs[32]            x = q d
//   Q4_K 256 values: f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale + 6-bit min), u8 qs[128]
//                    x = d sc nibble - dmin m, per 32-value sub-block
//   Q6_K 256 values: u8 ql[128] (low 4 bits), u8 qh[64] (high 2 bits), i8 scales[16], f16 d
//                    x = d scale (q - 32), per 16-value sub-block
#include <fmt/format.h>

#include <cstring>

#include "kvlab/block_quant.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"

namespace kvlab {
namespace {

using block_field::f16;
using block_field::u8;

// Scale and min of Q4_K sub-block j (0-7), each 6 bits, packed in 12 bytes (get_scale_min_k4).
void q4_k_scale_min(int j, const std::byte* q, std::uint8_t& scale, std::uint8_t& min) {
  if (j < 4) {
    scale = u8(q + j) & 63;
    min = u8(q + j + 4) & 63;
  } else {
    scale = static_cast<std::uint8_t>((u8(q + j + 4) & 0xF) | ((u8(q + j - 4) >> 6) << 4));
    min = static_cast<std::uint8_t>((u8(q + j + 4) >> 4) | ((u8(q + j) >> 6) << 4));
  }
}

void q4_k_block(const std::byte* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const std::byte* scales = b + 4;
  const std::byte* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32, y += 64) {
    std::uint8_t sc = 0, m = 0;
    q4_k_scale_min(is, scales, sc, m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    q4_k_scale_min(is + 1, scales, sc, m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(u8(q + l) & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[32 + l] = d2 * static_cast<float>(u8(q + l) >> 4) - m2;
  }
}

void q6_k_block(const std::byte* b, float* y) {
  const std::byte* ql = b;
  const std::byte* qh = b + 128;
  const std::byte* sc = b + 192;
  const float d = f16(b + 208);
  auto scale = [&](int i) { return static_cast<float>(static_cast<std::int8_t>(u8(sc + i))); };
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((u8(ql + l) & 0xF) | (((u8(qh + l) >> 0) & 3) << 4)) - 32;
      const int q2 = ((u8(ql + l + 32) & 0xF) | (((u8(qh + l) >> 2) & 3) << 4)) - 32;
      const int q3 = ((u8(ql + l) >> 4) | (((u8(qh + l) >> 4) & 3) << 4)) - 32;
      const int q4 = ((u8(ql + l + 32) >> 4) | (((u8(qh + l) >> 6) & 3) << 4)) - 32;
      y[l] = d * scale(is) * static_cast<float>(q1);
      y[l + 32] = d * scale(is + 2) * static_cast<float>(q2);
      y[l + 64] = d * scale(is + 4) * static_cast<float>(q3);
      y[l + 96] = d * scale(is + 6) * static_cast<float>(q4);
    }
  }
}

}  // namespace

void gguf_dequantize(std::uint32_t type, std::span<const std::byte> source,
                     std::span<float> destination) {
  const auto layout = gguf_block_layout(type);
  if (!layout)
    throw Error(fmt::format("GGUF tensor type {} is not one kvlab reads", gguf_type_name(type)));
  const auto count = static_cast<std::int64_t>(destination.size());
  if (count % layout->elements != 0 ||
      static_cast<std::int64_t>(source.size()) != count / layout->elements * layout->bytes)
    throw Error(fmt::format("{}: {} bytes do not hold {} values", gguf_type_name(type),
                            source.size(), count));
  switch (static_cast<GgufTensorType>(type)) {
    case GgufTensorType::f32:
      convert_to_f32(DType::dtype_f32, source, destination);
      return;
    case GgufTensorType::f16:
      convert_to_f32(DType::dtype_f16, source, destination);
      return;
    case GgufTensorType::bf16:
      convert_to_f32(DType::dtype_bf16, source, destination);
      return;
    default:
      break;
  }
  void (*block)(const std::byte*, float*) = nullptr;
  switch (static_cast<GgufTensorType>(type)) {
    case GgufTensorType::q4_0:
      return dequantize_blocks(BlockFormat::q4_0, source, destination);
    case GgufTensorType::q4_1:
      return dequantize_blocks(BlockFormat::q4_1, source, destination);
    case GgufTensorType::q8_0:
      return dequantize_blocks(BlockFormat::q8_0, source, destination);
    case GgufTensorType::q5_0:
      return dequantize_blocks(BlockFormat::q5_0, source, destination);
    case GgufTensorType::q5_1:
      return dequantize_blocks(BlockFormat::q5_1, source, destination);
    case GgufTensorType::q4_k:
      block = q4_k_block;
      break;
    case GgufTensorType::q6_k:
      block = q6_k_block;
      break;
    default:
      break;
  }
  const std::int64_t blocks = count / layout->elements;
  for (std::int64_t i = 0; i < blocks; ++i)
    block(source.data() + i * layout->bytes, destination.data() + i * layout->elements);
}

}  // namespace kvlab
