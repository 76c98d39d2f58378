#pragma once
// Element types of tensors in safetensors files and of KV caches.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace kvlab {

// Every dtype the safetensors format defines, then the grouped formats of quantized KV caches
// (no safetensors name). kvlab computes in fp32; it converts f32/f16/bf16/f64 tensors on load
// (see convert_to_f32) and rejects the others for weights.
enum class DType : std::uint8_t {
  dtype_f64,
  dtype_f32,
  dtype_f16,
  dtype_bf16,
  dtype_f8_e4m3,
  dtype_f8_e5m2,
  dtype_i64,
  dtype_i32,
  dtype_i16,
  dtype_i8,
  dtype_u8,
  dtype_bool,
  // Quantized KV rows (one row = one K or V head of one token): values in groups that share a
  // scale, stored beside them, so a row's bytes are dtype_row_bytes, not values x a size.
  dtype_kv_int8,  // "int8": int8 values, one fp32 scale per row (absmax / 127, per token, head)
  dtype_q8_0,     // "q8_0": llama.cpp's block of 32: fp16 scale + 32 int8 (34 bytes)
  dtype_q4_0,     // "q4_0": llama.cpp's block of 32: fp16 scale + 16 bytes of nibbles (18 bytes)
  // Asymmetric blocks of 32 (x = code x scale + min; KIVI's per-token quantization, the
  // baseline its per-channel keys beat at 2 bits):
  dtype_q4_1,     // "q4_1": llama.cpp's: fp16 scale, fp16 min, 16 bytes of nibbles (20 bytes)
  dtype_kv_int2,  // "int2": fp16 scale, fp16 min, 8 bytes of 2-bit codes (12 bytes)
  // KIVI (Liu et al. 2024): keys quantized per channel over groups of 32 tokens, values per token
  // (as int2 / q4_1 rows), the open group of each sequence kept in fp16 until its 32nd token
  // (kvlab/kv/kivi_groups.hpp). A row is as long as the value format's: int2's 12 bytes per 32
  // values (kivi2) or q4_1's 20 (kivi4); a key row holds its codes and a 32nd of its group's
  // per-channel scales and mins.
  dtype_kivi2,  // "kivi2": 2-bit codes
  dtype_kivi4,  // "kivi4": 4-bit codes
};

// Bytes per value; 0 for the grouped KV formats (dtype_row_bytes).
std::size_t dtype_size(DType dtype);
// Bytes of a row of `values` values in `dtype`, scales included. Precondition: dtype_row_fits.
std::int64_t dtype_row_bytes(DType dtype, std::int64_t values);
// The KV formats of 32-value blocks, each with its own scale: q8_0, q4_0, q4_1, int2.
bool dtype_is_kv_block_format(DType dtype);
// kivi2, kivi4; and the per-token format of their value rows (int2, q4_1).
bool dtype_is_kivi(DType dtype);
DType kivi_value_dtype(DType dtype);
// False for a row length a block format cannot hold (q8_0, q4_0, q4_1, int2, kivi2, kivi4: a
// multiple of 32).
bool dtype_row_fits(DType dtype, std::int64_t values);
// The fp32 value of every fp8 e4m3 byte (e4m3fn: no infinities, 0x7f and 0xff are NaN).
const float* fp8_e4m3_values();
// The safetensors spelling: "F32", "BF16", ...
std::string_view dtype_safetensors_name(DType dtype);
std::optional<DType> dtype_from_safetensors_name(std::string_view name);
// The CLI/TOML spelling: "f32", "f16", "bf16", "fp8" (fp8 = f8_e4m3, for memory arithmetic).
std::string_view dtype_short_name(DType dtype);
std::optional<DType> dtype_from_short_name(std::string_view name);

// True for the dtypes convert_to_f32 accepts.
bool dtype_converts_to_f32(DType dtype);

// Converts n elements (little-endian bytes, one row: dtype_row_bytes(dtype, n) of them) to
// fp32. Precondition: dtype_converts_to_f32, or a KV dtype (fp8 and the grouped formats; a
// grouped row is quantized as one row: int8's one scale covers all n values; a kivi dtype's row
// is its value row: kivi_value_dtype's).
void convert_to_f32(DType dtype, std::span<const std::byte> source, std::span<float> destination);
// Converts fp32 values to f32/f16/bf16 bytes with round-to-nearest-even (bit-exact everywhere),
// to fp8 e4m3 (nearest even, saturated at +-448) or to a grouped format's row (llama.cpp's
// quantize_row_q8_0_ref / q4_0_ref for q8_0 and q4_0).
void convert_from_f32(DType dtype, std::span<const float> source, std::span<std::byte> destination);

}  // namespace kvlab
