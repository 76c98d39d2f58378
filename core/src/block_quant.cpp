#include "kvlab/block_quant.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "kvlab/dtype.hpp"

namespace kvlab {
namespace {

void put_f16(float value, std::byte* out) {
  convert_from_f32(DType::dtype_f16, {&value, 1}, {out, 2});
}

using block_field::f16;
using block_field::u8;

void dequantize_q8_0(const std::byte* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < 32; ++j)
    y[j] = static_cast<float>(static_cast<std::int8_t>(u8(b + 2 + j))) * d;
}

void dequantize_q4_0(const std::byte* b, float* y) {
  const float d = f16(b);
  const std::byte* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((u8(qs + j) & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((u8(qs + j) >> 4) - 8) * d;
  }
}

void dequantize_q4_1(const std::byte* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const std::byte* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(u8(qs + j) & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(u8(qs + j) >> 4) * d + m;
  }
}

// static_cast<int>(v) clamped to [lo, hi], and `otherwise` for a NaN (an infinite value in a
// block makes its scale infinite and x / scale NaN): the same as llama.cpp's casts for every
// finite block, and defined for the rest.
int to_int(float v, int lo, int hi, int otherwise) {
  if (std::isnan(v)) return otherwise;
  return static_cast<int>(std::clamp(v, static_cast<float>(lo), static_cast<float>(hi)));
}

void quantize_q8_0(const float* x, std::byte* out) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
  put_f16(d, out);
  for (int j = 0; j < 32; ++j)
    out[2 + j] = static_cast<std::byte>(
        static_cast<std::int8_t>(to_int(std::round(x[j] * id), -128, 127, 0)));
}

void quantize_q4_0(const float* x, std::byte* out) {
  float amax = 0, max = 0;  // max: the value of largest magnitude, with its sign
  for (int j = 0; j < 32; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  const float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
  put_f16(d, out);
  auto nibble = [&](float v) { return static_cast<std::uint8_t>(to_int(v * id + 8.5f, 0, 15, 8)); };
  for (int j = 0; j < 16; ++j)
    out[2 + j] = static_cast<std::byte>(nibble(x[j]) | (nibble(x[j + 16]) << 4));
}

void quantize_q4_1(const float* x, std::byte* out) {
  const auto [min_it, max_it] = std::minmax_element(x, x + 32);
  const float min = *min_it, d = (*max_it - min) / 15.0f, id = d != 0 ? 1.0f / d : 0.0f;
  put_f16(d, out);
  put_f16(min, out + 2);
  auto nibble = [&](float v) {
    return static_cast<std::uint8_t>(to_int((v - min) * id + 0.5f, 0, 15, 0));
  };
  for (int j = 0; j < 16; ++j)
    out[4 + j] = static_cast<std::byte>(nibble(x[j]) | (nibble(x[j + 16]) << 4));
}

}  // namespace

float block_field::f16(const std::byte* p) {
  float value = 0;
  convert_to_f32(DType::dtype_f16, {p, 2}, {&value, 1});
  return value;
}

std::size_t block_bytes(BlockFormat format) {
  return format == BlockFormat::q8_0 ? 34 : format == BlockFormat::q4_0 ? 18 : 20;
}

void quantize_blocks(BlockFormat format, std::span<const float> source,
                     std::span<std::byte> destination) {
  void (*block)(const float*, std::byte*) = format == BlockFormat::q8_0   ? quantize_q8_0
                                            : format == BlockFormat::q4_0 ? quantize_q4_0
                                                                          : quantize_q4_1;
  const std::size_t blocks = source.size() / kBlockValues, bytes = block_bytes(format);
  assert(source.size() % kBlockValues == 0 && destination.size() == blocks * bytes);
  for (std::size_t b = 0; b < blocks; ++b)
    block(source.data() + kBlockValues * b, destination.data() + bytes * b);
}

void dequantize_blocks(BlockFormat format, std::span<const std::byte> source,
                       std::span<float> destination) {
  void (*block)(const std::byte*, float*) = format == BlockFormat::q8_0   ? dequantize_q8_0
                                            : format == BlockFormat::q4_0 ? dequantize_q4_0
                                                                          : dequantize_q4_1;
  const std::size_t blocks = destination.size() / kBlockValues, bytes = block_bytes(format);
  assert(destination.size() % kBlockValues == 0 && source.size() == blocks * bytes);
  for (std::size_t b = 0; b < blocks; ++b)
    block(source.data() + bytes * b, destination.data() + kBlockValues * b);
}

}  // namespace kvlab
