#include "kvlab/dtype.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <array>
#include <cassert>
#include <cstring>

namespace kvlab {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view safetensors_name;
  std::string_view short_name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 12> kDTypes{{
    {DType::dtype_f64, "F64", "f64", 8},
    {DType::dtype_f32, "F32", "f32", 4},
    {DType::dtype_f16, "F16", "f16", 2},
    {DType::dtype_bf16, "BF16", "bf16", 2},
    {DType::dtype_f8_e4m3, "F8_E4M3", "fp8", 1},
    {DType::dtype_f8_e5m2, "F8_E5M2", "fp8_e5m2", 1},
    {DType::dtype_i64, "I64", "i64", 8},
    {DType::dtype_i32, "I32", "i32", 4},
    {DType::dtype_i16, "I16", "i16", 2},
    {DType::dtype_i8, "I8", "i8", 1},
    {DType::dtype_u8, "U8", "u8", 1},
    {DType::dtype_bool, "BOOL", "bool", 1},
}};

const DTypeInfo& info(DType dtype) {
  return kDTypes[static_cast<std::size_t>(dtype)];
}

template <typename T>
T load_unaligned(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

}  // namespace

std::size_t dtype_size(DType dtype) {
  return info(dtype).size;
}
std::string_view dtype_safetensors_name(DType dtype) {
  return info(dtype).safetensors_name;
}
std::string_view dtype_short_name(DType dtype) {
  return info(dtype).short_name;
}

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.safetensors_name == name) return entry.dtype;
  return std::nullopt;
}

std::optional<DType> dtype_from_short_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.short_name == name) return entry.dtype;
  return std::nullopt;
}

bool dtype_converts_to_f32(DType dtype) {
  return dtype == DType::dtype_f32 || dtype == DType::dtype_f16 || dtype == DType::dtype_bf16 ||
         dtype == DType::dtype_f64;
}

void convert_to_f32(DType dtype, std::span<const std::byte> source, std::span<float> destination) {
  const std::size_t n = destination.size();
  assert(source.size() == n * dtype_size(dtype));
  if (n == 0) return;  // an empty tensor: its spans may be null, which memcpy must not see
  const std::byte* p = source.data();
  switch (dtype) {
    case DType::dtype_f32:
      std::memcpy(destination.data(), p, n * sizeof(float));
      return;
    case DType::dtype_f64:
      for (std::size_t i = 0; i < n; ++i)
        destination[i] = static_cast<float>(load_unaligned<double>(p + 8 * i));
      return;
    case DType::dtype_f16:
      for (std::size_t i = 0; i < n; ++i)
        destination[i] = static_cast<float>(
            Eigen::numext::bit_cast<Eigen::half>(load_unaligned<std::uint16_t>(p + 2 * i)));
      return;
    case DType::dtype_bf16:
      for (std::size_t i = 0; i < n; ++i)
        destination[i] = static_cast<float>(
            Eigen::numext::bit_cast<Eigen::bfloat16>(load_unaligned<std::uint16_t>(p + 2 * i)));
      return;
    default:
      assert(false && "convert_to_f32: unsupported dtype");
  }
}

void convert_from_f32(DType dtype, std::span<const float> source,
                      std::span<std::byte> destination) {
  const std::size_t n = source.size();
  assert(destination.size() == n * dtype_size(dtype));
  if (n == 0) return;
  std::byte* p = destination.data();
  switch (dtype) {
    case DType::dtype_f32:
      std::memcpy(p, source.data(), n * sizeof(float));
      return;
    case DType::dtype_f16:
      for (std::size_t i = 0; i < n; ++i) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(source[i]));
        std::memcpy(p + 2 * i, &bits, 2);
      }
      return;
    case DType::dtype_bf16:
      for (std::size_t i = 0; i < n; ++i) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(source[i]));
        std::memcpy(p + 2 * i, &bits, 2);
      }
      return;
    default:
      assert(false && "convert_from_f32: unsupported dtype");
  }
}

}  // namespace kvlab
