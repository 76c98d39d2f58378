#pragma once
// Deterministic random weights for LLaMA-family models, in Hugging Face tensor names.
// Same (config, seed) -> the same fp32 values, bit for bit, on any machine: values come from
// a counter-based integer hash and integer arithmetic, never from libm or <random>'s
// implementation-defined distributions.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kvlab/dtype.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

struct WeightSpec {
  std::string name;                 // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;  // HF layout: Linear weights are (out_features, in_features)
  bool is_norm = false;             // RMSNorm gains: initialised to 1
};

// Every tensor a LlamaForCausalLM checkpoint holds for `config` (lm_head.weight only when
// embeddings are not tied), in a fixed order.
std::vector<WeightSpec> llama_weight_specs(const ModelConfig& config);

// The values of one tensor: norms are 1; other tensors are approximately normal with
// standard deviation `init_std` (Irwin-Hall sum of 4 uniforms, scaled; exact integer math).
std::vector<float> random_tensor_values(const WeightSpec& spec, std::uint64_t seed,
                                        double init_std = 0.02);

// Writes config.json + model.safetensors (tensors in `dtype`: f32, f16 or bf16) into
// `directory`, creating it. Throws kvlab::Error (size-only preset, unwritable folder, ...).
void write_random_model(const ModelConfig& config, std::uint64_t seed, DType dtype,
                        const std::filesystem::path& directory);

}  // namespace kvlab
