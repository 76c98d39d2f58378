#include "kvlab/model/weight_init.hpp"

#include <fmt/format.h>

#include <cmath>
#include <fstream>

#include "kvlab/error.hpp"
#include "kvlab/model/safetensors.hpp"
#include "kvlab/splitmix64.hpp"

namespace kvlab {
namespace {

// SplitMix64 finaliser: a bijective 64-bit mix, used as a counter-based generator.
std::uint64_t mix64(std::uint64_t x) {
  return splitmix64_mix(x + 0x9e3779b97f4a7c15ULL);
}

// FNV-1a of the tensor name: each tensor's stream depends on its name, not on write order.
std::uint64_t name_hash(const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

}  // namespace

std::vector<WeightSpec> llama_weight_specs(const ModelConfig& c) {
  const std::int64_t dim = c.hidden_size;
  std::vector<WeightSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, dim}, false});
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    specs.push_back({p + "input_layernorm.weight", {dim}, true});
    specs.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), dim}, false});
    if (c.is_mla()) {  // DeepSeek-V2-Lite's names
      specs.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", {c.latent_dim(), dim}, false});
      specs.push_back({p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, true});
      specs.push_back(
          {p + "self_attn.kv_b_proj.weight",
           {c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
           false});
    } else {
      specs.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), dim}, false});
      specs.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), dim}, false});
    }
    specs.push_back({p + "self_attn.o_proj.weight", {dim, c.attention_output_dim()}, false});
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, true});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, true});
    }
    if (c.post_norms) {  // Gemma: after the attention; then before and after the MLP
      specs.push_back({p + "post_attention_layernorm.weight", {dim}, true});
      specs.push_back({p + "pre_feedforward_layernorm.weight", {dim}, true});
      specs.push_back({p + "post_feedforward_layernorm.weight", {dim}, true});
    } else {  // LLaMA: before the MLP
      specs.push_back({p + "post_attention_layernorm.weight", {dim}, true});
    }
    specs.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, dim}, false});
    specs.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, dim}, false});
    specs.push_back({p + "mlp.down_proj.weight", {dim, c.intermediate_size}, false});
  }
  specs.push_back({"model.norm.weight", {dim}, true});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, dim}, false});
  return specs;
}

std::vector<float> random_tensor_values(const WeightSpec& spec, std::uint64_t seed,
                                        double init_std) {
  std::int64_t n = 1;
  for (auto d : spec.shape) n *= d;
  std::vector<float> values(static_cast<std::size_t>(n));
  if (spec.is_norm) {
    std::fill(values.begin(), values.end(), 1.0f);
    return values;
  }
  // Sum of four 24-bit uniforms, centred: an integer in [-2^25, 2^25) with variance 4/12 x 2^48.
  // One 64-bit hash gives two 24-bit draws, so two hashes per value. The scale is a correctly
  // rounded sqrt and product, and int64 -> double -> float conversions are exact IEEE
  // operations: the result is the same on every conforming machine.
  const double scale = init_std * std::sqrt(3.0) / static_cast<double>(1 << 24);
  const std::uint64_t stream = mix64(seed ^ mix64(name_hash(spec.name)));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t a = mix64(stream + 2 * static_cast<std::uint64_t>(i));
    const std::uint64_t b = mix64(stream + 2 * static_cast<std::uint64_t>(i) + 1);
    const std::int64_t sum =
        static_cast<std::int64_t>(a & 0xffffff) + static_cast<std::int64_t>((a >> 24) & 0xffffff) +
        static_cast<std::int64_t>(b & 0xffffff) + static_cast<std::int64_t>((b >> 24) & 0xffffff) -
        (std::int64_t{1} << 25);
    values[static_cast<std::size_t>(i)] = static_cast<float>(static_cast<double>(sum) * scale);
  }
  return values;
}

void write_random_model(const ModelConfig& config, std::uint64_t seed, DType dtype,
                        const std::filesystem::path& directory) {
  if (config.size_only)
    throw Error(fmt::format(
        "preset \"{}\" is size-only ({:.1f}B parameters): it exists for `kvlab memory`; "
        "use tiny, stories15m or stories110m for runnable weights",
        config.name, static_cast<double>(config.parameter_count()) / 1e9));
  if (config.is_gemma3())  // kvlab reads Gemma 3 from GGUF only (the norms' 1 + w convention)
    throw Error(fmt::format(
        "preset \"{}\" is a Gemma 3 model, which kvlab reads from GGUF files only, not from a "
        "safetensors folder: run it by name (`--model {}`: random weights in memory)",
        config.name, config.name));
  if (config.is_mla())  // a DeepseekV2ForCausalLM folder is not read (model_config.cpp)
    throw Error(fmt::format(
        "preset \"{}\" has latent attention, which kvlab runs from its preset, not from a "
        "safetensors folder: run it by name (`--model {}`: random weights in memory)",
        config.name, config.name));
  if (dtype != DType::dtype_f32 && dtype != DType::dtype_f16 && dtype != DType::dtype_bf16)
    throw Error(fmt::format("cannot write weights as {}: choose f32, f16 or bf16",
                            dtype_short_name(dtype)));
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw Error(fmt::format("cannot create model folder {}: {}", directory.string(), ec.message()));

  const auto specs = llama_weight_specs(config);
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
  storage.reserve(specs.size());
  for (const auto& spec : specs) {
    const auto values = random_tensor_values(spec, seed);
    auto& bytes = storage.emplace_back(values.size() * dtype_size(dtype));
    convert_from_f32(dtype, values, bytes);
    tensors.push_back({spec.name, dtype, spec.shape, bytes});
  }
  write_safetensors(directory / "model.safetensors", tensors,
                    {{"format", "pt"}, {"kvlab_seed", std::to_string(seed)}});
  ModelConfig written = config;
  written.name = directory.string();
  const char* torch_dtype = dtype == DType::dtype_f32   ? "float32"
                            : dtype == DType::dtype_f16 ? "float16"
                                                        : "bfloat16";
  const std::string json = model_config_to_json(written, torch_dtype);
  std::ofstream out(directory / "config.json", std::ios::binary | std::ios::trunc);
  out << json;
  if (!out) throw Error(fmt::format("cannot write {}", (directory / "config.json").string()));
}

}  // namespace kvlab
