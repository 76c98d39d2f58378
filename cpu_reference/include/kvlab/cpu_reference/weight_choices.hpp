#pragma once
// The names `[backend] weights` and `kvlab generate --weights` accept, header-only so that the
// experiment parser checks them without linking the CPU backend: "stored" (a GGUF file's own
// tensor types; fp32 for presets and safetensors folders), then every WeightFormat's name in
// enum order (weight_matrix.cpp asserts that order at compile time).
#include <array>
#include <string_view>

namespace kvlab::cpu {

inline constexpr std::array<std::string_view, 7> kWeightChoices{"stored", "f32",  "f16", "bf16",
                                                                "q8_0",   "q4_0", "q4_1"};

// `[backend] activations` and `--activations`: ActivationFormat's names in enum order.
inline constexpr std::array<std::string_view, 3> kActivationChoices{"f32", "q8", "bf16"};

}  // namespace kvlab::cpu
