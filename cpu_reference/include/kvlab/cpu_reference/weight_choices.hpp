#pragma once
// The formats the cpu backend multiplies in, and the names `[backend] weights` and
// `kvlab generate --weights` accept, header-only so that the experiment parser checks them
// without the CPU backend's headers: "stored" (a GGUF file's own
// tensor types; fp32 for presets and safetensors folders), then every WeightFormat's name in
// enum order (weight_matrix.cpp asserts that order at compile time).
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvlab::cpu {

enum class WeightFormat : std::uint8_t { f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 };

// What a product takes as the other operand: fp32 activations (the reference's function over the
// dequantized weights; the default), or, as llama.cpp does, activations rounded to the weights'
// own dot-product type, which is faster and no longer the reference's function (kvlab check
// refuses it):
//   q8    Q8_0/Q4_0/Q4_1 matrices: activations rounded per 32-value block to 8-bit integers
//         (scale = max|x| / 127), integer dot products (llama.cpp's q8_0/q8_1)
//   bf16  bf16 matrices: activations rounded to bf16, bf16 pair products summed in fp32
// Matrices in the other formats (f32, f16, Q5_0, Q5_1) keep fp32 activations.
enum class ActivationFormat : std::uint8_t { f32, q8, bf16 };

inline constexpr std::array<std::string_view, 9> kWeightChoices{
    "stored", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"};

// `[backend] activations` and `--activations`: ActivationFormat's names in enum order.
inline constexpr std::array<std::string_view, 3> kActivationChoices{"f32", "q8", "bf16"};

// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"; nullopt for another name ("stored"
// included).
constexpr std::optional<WeightFormat> weight_format_from_name(std::string_view name) {
  for (std::size_t i = 1; i < kWeightChoices.size(); ++i)
    if (kWeightChoices[i] == name) return static_cast<WeightFormat>(i - 1);
  return std::nullopt;
}
// The kWeightChoices name of a format, "stored" for nullopt.
constexpr std::string_view weight_choice_name(std::optional<WeightFormat> format) {
  return kWeightChoices[format ? static_cast<std::size_t>(*format) + 1 : 0];
}
constexpr std::string_view activation_format_name(ActivationFormat format) {  // "f32", "q8", ..
  return kActivationChoices[static_cast<std::size_t>(format)];
}
constexpr std::optional<ActivationFormat> activation_format_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kActivationChoices.size(); ++i)
    if (kActivationChoices[i] == name) return static_cast<ActivationFormat>(i);
  return std::nullopt;
}

}  // namespace kvlab::cpu
