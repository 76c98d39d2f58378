#include "kvlab/block_quant.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

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

// Q5_0 (codes centred on 16, no minimum) or Q5_1 (an fp16 minimum after the scale), as
// dequantize_row_q5_0 / _q5_1.
template <bool WithMin>
void dequantize_q5(const std::byte* b, float* y) {
  const float d = f16(b);
  const float m = WithMin ? f16(b + 2) : 0.0f;
  const std::byte* rest = b + (WithMin ? 4 : 2);
  std::uint32_t qh = 0;
  std::memcpy(&qh, rest, 4);  // little-endian, as the file and x86-64 are
  const std::byte* qs = rest + 4;
  const int centre = WithMin ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    const int high_0 = static_cast<int>((qh >> j) << 4 & 0x10);
    const int high_1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    const int x0 = ((u8(qs + j) & 0x0F) | high_0) - centre;
    const int x1 = ((u8(qs + j) >> 4) | high_1) - centre;
    y[j] = static_cast<float>(x0) * d + m;
    y[j + 16] = static_cast<float>(x1) * d + m;
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

// The block's value of largest magnitude, with its sign (the first such), as the _0 formats'
// quantizers pick it.
float signed_max(const float* x) {
  float amax = 0, max = 0;
  for (int j = 0; j < 32; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void quantize_q4_0(const float* x, std::byte* out) {
  const float d = signed_max(x) / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
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

// 32 five-bit codes into qh (their fifth bits, bit j for code j) and 16 bytes of nibbles.
void put_q5_codes(const std::uint8_t (&codes)[32], std::byte* qh_out, std::byte* qs) {
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    qs[j] = static_cast<std::byte>((codes[j] & 0x0F) | ((codes[j + 16] & 0x0F) << 4));
    qh |= static_cast<std::uint32_t>(codes[j] >> 4) << j;
    qh |= static_cast<std::uint32_t>(codes[j + 16] >> 4) << (j + 16);
  }
  std::memcpy(qh_out, &qh, 4);
}

// As quantize_row_q5_0_ref: the value of largest magnitude maps to code 0 (-16 steps).
void quantize_q5_0(const float* x, std::byte* out) {
  const float d = signed_max(x) / -16.0f, id = d != 0 ? 1.0f / d : 0.0f;
  put_f16(d, out);
  std::uint8_t codes[32];
  for (int j = 0; j < 32; ++j)
    codes[j] = static_cast<std::uint8_t>(to_int(x[j] * id + 16.5f, 0, 31, 16));
  put_q5_codes(codes, out + 2, out + 6);
}

// As quantize_row_q5_1_ref: 31 steps from the block's minimum to its maximum.
void quantize_q5_1(const float* x, std::byte* out) {
  const auto [min_it, max_it] = std::minmax_element(x, x + 32);
  const float min = *min_it, d = (*max_it - min) / 31.0f, id = d != 0 ? 1.0f / d : 0.0f;
  put_f16(d, out);
  put_f16(min, out + 2);
  std::uint8_t codes[32];
  for (int j = 0; j < 32; ++j)
    codes[j] = static_cast<std::uint8_t>(to_int((x[j] - min) * id + 0.5f, 0, 31, 0));
  put_q5_codes(codes, out + 4, out + 8);
}

}  // namespace

float block_field::f16(const std::byte* p) {
  float value = 0;
  convert_to_f32(DType::dtype_f16, {p, 2}, {&value, 1});
  return value;
}

std::size_t block_bytes(BlockFormat format) {
  constexpr std::size_t kBytes[] = {34, 18, 20, 22, 24};
  return kBytes[static_cast<std::size_t>(format)];
}

void quantize_blocks(BlockFormat format, std::span<const float> source,
                     std::span<std::byte> destination) {
  constexpr void (*kQuantize[])(const float*, std::byte*) = {
      quantize_q8_0, quantize_q4_0, quantize_q4_1, quantize_q5_0, quantize_q5_1};
  void (*block)(const float*, std::byte*) = kQuantize[static_cast<std::size_t>(format)];
  const std::size_t blocks = source.size() / kBlockValues, bytes = block_bytes(format);
  assert(source.size() % kBlockValues == 0 && destination.size() == blocks * bytes);
  for (std::size_t b = 0; b < blocks; ++b)
    block(source.data() + kBlockValues * b, destination.data() + bytes * b);
}

void dequantize_blocks(BlockFormat format, std::span<const std::byte> source,
                       std::span<float> destination) {
  constexpr void (*kDequantize[])(const std::byte*, float*) = {
      dequantize_q8_0, dequantize_q4_0, dequantize_q4_1, dequantize_q5<false>, dequantize_q5<true>};
  void (*block)(const std::byte*, float*) = kDequantize[static_cast<std::size_t>(format)];
  const std::size_t blocks = destination.size() / kBlockValues, bytes = block_bytes(format);
  assert(destination.size() % kBlockValues == 0 && source.size() == blocks * bytes);
  for (std::size_t b = 0; b < blocks; ++b)
    block(source.data() + bytes * b, destination.data() + kBlockValues * b);
}

}  // namespace kvlab
