#include "kvlab/kv/kivi_groups.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "kvlab/block_quant.hpp"

namespace kvlab {
namespace {

// Channel j's code within its block of 32 in the code bytes of a row.
int code_at(int bits, const std::byte* codes, std::int64_t j) {
  const std::int64_t block = j / 32, within = j % 32;
  if (bits == 2) return (block_field::u8(codes + block * 8 + within % 8) >> (2 * (within / 8))) & 3;
  const std::uint8_t byte = block_field::u8(codes + block * 16 + within % 16);
  return within < 16 ? byte & 0xf : byte >> 4;
}

void put_code(int bits, std::byte* codes, std::int64_t j, int code) {
  const std::int64_t block = j / 32, within = j % 32;
  const int shift = bits == 2 ? static_cast<int>(2 * (within / 8)) : (within < 16 ? 0 : 4);
  std::byte& byte = codes[bits == 2 ? block * 8 + within % 8 : block * 16 + within % 16];
  byte |= static_cast<std::byte>(code << shift);
}

float stored_half(float value) {  // value rounded to fp16 and back
  std::byte bytes[2];
  convert_from_f32(DType::dtype_f16, {&value, 1}, bytes);
  return block_field::f16(bytes);
}

}  // namespace

std::int64_t kivi_open_groups(std::int64_t tokens, std::int64_t residual) {
  if (tokens <= 0) return 0;
  const std::int64_t groups = (tokens + kKiviGroup - 1) / kKiviGroup;
  return groups - (tokens > residual ? (tokens - residual) / kKiviGroup : 0);
}

int kivi_bits(DType dtype) {
  assert(dtype_is_kivi(dtype));
  return dtype == DType::dtype_kivi2 ? 2 : 4;
}

void kivi_seal_key_group(int bits, const float* keys, std::int64_t head_dim, std::byte* rows,
                         std::int64_t stride) {
  const auto hd = static_cast<std::size_t>(head_dim);
  const float top = static_cast<float>((1 << bits) - 1);
  std::vector<std::uint16_t> params(2 * hd);  // fp16 scales, then fp16 mins
  std::vector<float> scales(hd), mins(hd);
  for (std::size_t d = 0; d < hd; ++d) {
    float lo = keys[d], hi = keys[d];
    for (std::int64_t r = 1; r < kKiviGroup; ++r) {
      lo = std::fmin(lo, keys[static_cast<std::size_t>(r) * hd + d]);
      hi = std::fmax(hi, keys[static_cast<std::size_t>(r) * hd + d]);
    }
    scales[d] = stored_half((hi - lo) / top);
    mins[d] = stored_half(lo);
  }
  convert_from_f32(DType::dtype_f16, scales, std::as_writable_bytes(std::span(params).first(hd)));
  convert_from_f32(DType::dtype_f16, mins, std::as_writable_bytes(std::span(params).last(hd)));
  const std::int64_t code_bytes = kivi_code_bytes(bits, head_dim), share = head_dim / 8;
  const auto* param_bytes = reinterpret_cast<const std::byte*>(params.data());
  for (std::int64_t r = 0; r < kKiviGroup; ++r) {
    std::byte* row = rows + r * stride;
    std::memset(row, 0, static_cast<std::size_t>(code_bytes));
    const float* x = keys + static_cast<std::size_t>(r) * hd;
    for (std::size_t d = 0; d < hd; ++d) {
      const float inverse = scales[d] != 0 && std::isfinite(scales[d]) ? 1.0f / scales[d] : 0.0f;
      const float q = std::nearbyint((x[d] - mins[d]) * inverse);  // NaN: a non-finite value
      put_code(bits, row, static_cast<std::int64_t>(d),
               static_cast<int>(std::isnan(q) ? 0.0f : std::clamp(q, 0.0f, top)));
    }
    std::memcpy(row + code_bytes, param_bytes + r * share, static_cast<std::size_t>(share));
  }
}

void kivi_key_params(int bits, const std::byte* rows, std::int64_t stride, std::int64_t head_dim,
                     float* scales, float* mins) {
  // Attention reads a group's params once per query head: 16-bit gathers from the 32 rows (no
  // library calls, no heap), then one conversion of the 2 x head_dim halves.
  const std::int64_t code_bytes = kivi_code_bytes(bits, head_dim), per_row = head_dim / 16;
  std::uint16_t stack[2 * 256];
  std::vector<std::uint16_t> heap;
  std::uint16_t* halves = stack;
  if (head_dim > 256) {
    heap.resize(static_cast<std::size_t>(2 * head_dim));
    halves = heap.data();
  }
  for (std::int64_t r = 0; r < kKiviGroup; ++r) {
    const std::byte* share = rows + r * stride + code_bytes;
    for (std::int64_t i = 0; i < per_row; ++i)
      std::memcpy(halves + r * per_row + i, share + 2 * i, 2);
  }
  const auto hd = static_cast<std::size_t>(head_dim);
  const auto* bytes = reinterpret_cast<const std::byte*>(halves);
  convert_to_f32(DType::dtype_f16, {bytes, 2 * hd}, {scales, hd});
  convert_to_f32(DType::dtype_f16, {bytes + 2 * hd, 2 * hd}, {mins, hd});
}

void kivi_key_row_to_f32(int bits, const std::byte* row, std::int64_t head_dim, const float* scales,
                         const float* mins, float* out) {
  for (std::int64_t d = 0; d < head_dim; ++d)
    out[d] = static_cast<float>(code_at(bits, row, d)) * scales[d] + mins[d];
}

}  // namespace kvlab
