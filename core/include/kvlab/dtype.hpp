#pragma once
// Element types of tensors in safetensors files and of KV caches.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace kvlab {

// Every dtype the safetensors format defines. kvlab computes in fp32; it converts
// f32/f16/bf16/f64 tensors on load (see convert_to_f32) and rejects the others for weights.
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
};

std::size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "BF16", ...
std::string_view dtype_safetensors_name(DType dtype);
std::optional<DType> dtype_from_safetensors_name(std::string_view name);
// The CLI/TOML spelling: "f32", "f16", "bf16", "fp8" (fp8 = f8_e4m3, for memory arithmetic).
std::string_view dtype_short_name(DType dtype);
std::optional<DType> dtype_from_short_name(std::string_view name);

// True for the dtypes convert_to_f32 accepts.
bool dtype_converts_to_f32(DType dtype);

// Converts n elements (little-endian bytes) to fp32. Precondition: dtype_converts_to_f32.
void convert_to_f32(DType dtype, std::span<const std::byte> source, std::span<float> destination);
// Converts fp32 values to f32/f16/bf16 bytes with round-to-nearest-even (bit-exact everywhere).
void convert_from_f32(DType dtype, std::span<const float> source, std::span<std::byte> destination);

}  // namespace kvlab
