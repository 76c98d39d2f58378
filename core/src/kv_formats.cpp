#include "kv_formats.hpp"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvlab/block_quant.hpp"

namespace kvlab {
namespace {

constexpr std::int64_t kBlock = 32;           // values per q8_0 / q4_0 / q4_1 / int2 block
constexpr std::int64_t kInt2BlockBytes = 12;  // fp16 scale, fp16 min, 32 2-bit codes

// The llama.cpp block format of a q8_0 / q4_0 / q4_1 KV row, and the bytes of n values in it.
BlockFormat block_format(DType dtype) {
  if (dtype == DType::dtype_q8_0) return BlockFormat::q8_0;
  return dtype == DType::dtype_q4_0 ? BlockFormat::q4_0 : BlockFormat::q4_1;
}
std::size_t row_bytes(DType dtype, std::size_t n) {
  return static_cast<std::size_t>(dtype_row_bytes(dtype, static_cast<std::int64_t>(n)));
}

std::array<float, 256> make_fp8_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
    float magnitude = exponent == 0
                          ? std::ldexp(static_cast<float>(mantissa) / 8.0f, -6)
                          : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
    if ((code & 0x7f) == 0x7f) magnitude = std::numeric_limits<float>::quiet_NaN();
    table[static_cast<std::size_t>(code)] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = make_fp8_table();
  return table;
}

// Nearest e4m3 code (ties to the even code), saturated at +-448 (0x7e), NaN to 0x7f.
std::uint8_t fp8_from_f32(float x) {
  if (std::isnan(x)) return 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  const auto& table = fp8_table();
  // Codes 0..0x7e are the positive values in increasing order: the last one <= a.
  const auto above = std::upper_bound(table.begin(), table.begin() + 0x7f, a);
  const auto low =
      static_cast<std::uint8_t>(std::max<std::ptrdiff_t>(above - table.begin() - 1, 0));
  if (low == 0x7e) return sign | low;
  const float down = a - table[low], up = table[low + 1u] - a;
  const bool take_up = up < down || (up == down && (low & 1) != 0);
  return sign | static_cast<std::uint8_t>(low + (take_up ? 1 : 0));
}

void int8_row_from_f32(const float* x, std::size_t n, std::byte* row) {
  float amax = 0;
  for (std::size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f, inverse = scale != 0 ? 1.0f / scale : 0.0f;
  std::memcpy(row, &scale, 4);
  for (std::size_t i = 0; i < n; ++i) {
    const float q = std::nearbyint(x[i] * inverse);  // NaN for a NaN value or an infinite scale
    row[4 + i] = static_cast<std::byte>(
        static_cast<std::int8_t>(std::isnan(q) ? 0.0f : std::clamp(q, -127.0f, 127.0f)));
  }
}

void write_half(float value, std::byte* out) {
  convert_from_f32(DType::dtype_f16, {&value, 1}, {out, 2});
}

// int2 blocks of 32: [fp16 scale][fp16 min][8 bytes]; value j's code in byte j % 8, bits
// 2 (j / 8) (so 8 consecutive values share a shift), x = code x scale + min: KIVI's asymmetric
// per-token quantization (min and max of the group map to codes 0 and 3).
void int2_row_from_f32(const float* x, std::size_t n, std::byte* row) {
  for (std::size_t b = 0; b < n / kBlock; ++b, x += kBlock, row += kInt2BlockBytes) {
    float lo = x[0], hi = x[0];
    for (std::int64_t j = 1; j < kBlock; ++j) {
      lo = std::fmin(lo, x[j]);
      hi = std::fmax(hi, x[j]);
    }
    write_half((hi - lo) / 3.0f, row);
    write_half(lo, row + 2);
    // Codes against the stored (fp16) scale and min, so rounding sees what reading gives.
    const float scale = block_field::f16(row), low = block_field::f16(row + 2);
    const float inverse = scale != 0 && std::isfinite(scale) ? 1.0f / scale : 0.0f;
    std::uint8_t codes[8] = {};
    for (std::int64_t j = 0; j < kBlock; ++j) {
      const float q = std::nearbyint((x[j] - low) * inverse);
      const auto code = static_cast<std::uint8_t>(std::isnan(q) ? 0.0f : std::clamp(q, 0.0f, 3.0f));
      codes[j % 8] = static_cast<std::uint8_t>(codes[j % 8] | (code << (2 * (j / 8))));
    }
    std::memcpy(row + 4, codes, 8);
  }
}

void int2_row_to_f32(const std::byte* row, std::size_t n, float* out) {
  for (std::size_t b = 0; b < n / kBlock; ++b, out += kBlock, row += kInt2BlockBytes) {
    const float scale = block_field::f16(row), low = block_field::f16(row + 2);
    for (std::int64_t j = 0; j < kBlock; ++j) {
      const int code = (block_field::u8(row + 4 + j % 8) >> (2 * (j / 8))) & 3;
      out[j] = static_cast<float>(code) * scale + low;
    }
  }
}

}  // namespace

const float* fp8_e4m3_values() {
  return fp8_table().data();
}

std::int64_t dtype_row_bytes(DType dtype, std::int64_t values) {
  switch (dtype) {
    case DType::dtype_kv_int8:
      return values + 4;
    case DType::dtype_q8_0:
      return values / kBlock * 34;
    case DType::dtype_q4_0:
      return values / kBlock * 18;
    case DType::dtype_q4_1:
      return values / kBlock * 20;
    case DType::dtype_kv_int2:
    case DType::dtype_kivi2:
      return values / kBlock * kInt2BlockBytes;
    case DType::dtype_kivi4:
      return values / kBlock * 20;
    default:
      return values * static_cast<std::int64_t>(dtype_size(dtype));
  }
}

bool dtype_is_kv_block_format(DType dtype) {
  return dtype == DType::dtype_q8_0 || dtype == DType::dtype_q4_0 || dtype == DType::dtype_q4_1 ||
         dtype == DType::dtype_kv_int2;
}

bool dtype_is_kivi(DType dtype) {
  return dtype == DType::dtype_kivi2 || dtype == DType::dtype_kivi4;
}

DType kivi_value_dtype(DType dtype) {
  assert(dtype_is_kivi(dtype));
  return dtype == DType::dtype_kivi2 ? DType::dtype_kv_int2 : DType::dtype_q4_1;
}

bool dtype_row_fits(DType dtype, std::int64_t values) {
  return !(dtype_is_kv_block_format(dtype) || dtype_is_kivi(dtype)) || values % kBlock == 0;
}

bool is_kv_format(DType dtype) {
  return dtype == DType::dtype_f8_e4m3 || dtype == DType::dtype_kv_int8 ||
         dtype_is_kv_block_format(dtype) || dtype_is_kivi(dtype);
}

void kv_row_to_f32(DType dtype, const std::byte* row, std::size_t n, float* out) {
  if (dtype_is_kivi(dtype)) dtype = kivi_value_dtype(dtype);  // a value row
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(row);
  switch (dtype) {
    case DType::dtype_f8_e4m3:
      for (std::size_t i = 0; i < n; ++i) out[i] = fp8_table()[bytes[i]];
      return;
    case DType::dtype_kv_int8: {
      float scale;
      std::memcpy(&scale, row, 4);
      for (std::size_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(static_cast<std::int8_t>(bytes[4 + i])) * scale;
      return;
    }
    case DType::dtype_q8_0:
    case DType::dtype_q4_0:
    case DType::dtype_q4_1:
      return dequantize_blocks(block_format(dtype), {row, row_bytes(dtype, n)}, {out, n});
    case DType::dtype_kv_int2:
      return int2_row_to_f32(row, n, out);
    default:
      assert(false && "kv_row_to_f32: not a KV format");
  }
}

void kv_row_from_f32(DType dtype, const float* values, std::size_t n, std::byte* row) {
  if (dtype_is_kivi(dtype)) dtype = kivi_value_dtype(dtype);  // a value row
  switch (dtype) {
    case DType::dtype_f8_e4m3:
      for (std::size_t i = 0; i < n; ++i) row[i] = static_cast<std::byte>(fp8_from_f32(values[i]));
      return;
    case DType::dtype_kv_int8:
      return int8_row_from_f32(values, n, row);
    case DType::dtype_q8_0:
    case DType::dtype_q4_0:
    case DType::dtype_q4_1:
      return quantize_blocks(block_format(dtype), {values, n}, {row, row_bytes(dtype, n)});
    case DType::dtype_kv_int2:
      return int2_row_from_f32(values, n, row);
    default:
      assert(false && "kv_row_from_f32: not a KV format");
  }
}

}  // namespace kvlab
