#include "kvlab/cpu_reference/llama_weights.hpp"

#include <fmt/format.h>

#include <functional>
#include <optional>
#include <string_view>

#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/model/safetensors.hpp"
#include "kvlab/model/weight_init.hpp"

namespace kvlab::cpu {
namespace {

// Row blocks of row-major matrices are contiguous, so each checkpoint tensor is one span.
template <typename Matrix>
std::span<float> span_of(Matrix&& m) {
  return {m.data(), static_cast<std::size_t>(m.size())};
}

// A layer's tensors at the config's sizes (Gemma's extra norms only when it has them).
void size_layer(const ModelConfig& config, LayerWeights& layer) {
  const std::int64_t dim = config.hidden_size;
  layer.q_dim = config.q_dim();
  layer.kv_dim = config.is_mla() ? 0 : config.kv_dim();
  layer.ffn_dim = config.intermediate_size;
  layer.attention_norm.resize(dim);
  layer.w_qkv.resize(config.q_dim() + (config.is_mla() ? config.latent_dim() : 2 * layer.kv_dim),
                     dim);
  layer.wo.resize(dim, config.attention_output_dim());
  if (config.is_mla()) {
    layer.kv_a_norm.resize(config.kv_lora_rank);
    layer.w_kv_b.resize(config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim),
                        config.kv_lora_rank);
  }
  layer.mlp_norm.resize(dim);
  layer.w_gate_up.resize(2 * config.intermediate_size, dim);
  layer.w_down.resize(dim, config.intermediate_size);
  if (config.qk_norm) {
    layer.q_norm.resize(config.head_dim);
    layer.k_norm.resize(config.head_dim);
  }
  if (config.post_norms) {
    layer.attention_post_norm.resize(dim);
    layer.mlp_post_norm.resize(dim);
  }
}

// Where the layer tensor `field` (its name after model.layers.N.) goes; nullopt for none.
std::optional<std::span<float>> layer_tensor(LayerWeights& layer, std::string_view field,
                                             bool post_norms) {
  if (field == "input_layernorm.weight") return span_of(layer.attention_norm);
  if (field == "self_attn.q_proj.weight") return span_of(layer.wq());
  if (field == "self_attn.kv_a_proj_with_mqa.weight") return span_of(layer.w_kv_a());
  if (field == "self_attn.kv_a_layernorm.weight") return span_of(layer.kv_a_norm);
  if (field == "self_attn.kv_b_proj.weight") return span_of(layer.w_kv_b);
  if (field == "self_attn.k_proj.weight") return span_of(layer.wk());
  if (field == "self_attn.v_proj.weight") return span_of(layer.wv());
  if (field == "self_attn.o_proj.weight") return span_of(layer.wo);
  if (field == "post_attention_layernorm.weight")  // Gemma's after the attention
    return span_of(post_norms ? layer.attention_post_norm : layer.mlp_norm);
  if (field == "pre_feedforward_layernorm.weight") return span_of(layer.mlp_norm);
  if (field == "post_feedforward_layernorm.weight") return span_of(layer.mlp_post_norm);
  if (field == "self_attn.q_norm.weight") return span_of(layer.q_norm);
  if (field == "self_attn.k_norm.weight") return span_of(layer.k_norm);
  if (field == "mlp.gate_proj.weight") return span_of(layer.w_gate());
  if (field == "mlp.up_proj.weight") return span_of(layer.w_up());
  if (field == "mlp.down_proj.weight") return span_of(layer.w_down);
  return std::nullopt;
}

// Where tensor `name` goes in `w`; a name llama_weight_specs does not give is an internal error.
std::span<float> tensor_of(LlamaWeights& w, const std::string& name) {
  if (name == "model.embed_tokens.weight") return span_of(w.embedding);
  if (name == "model.norm.weight") return span_of(w.final_norm);
  if (name == "lm_head.weight") return span_of(w.lm_head);
  std::size_t layer_index = 0;
  char field[64] = {};
  if (std::sscanf(name.c_str(), "model.layers.%zu.%63s", &layer_index, field) == 2)
    if (auto span = layer_tensor(w.layers.at(layer_index), field, w.config.post_norms))
      return *span;
  throw Error(fmt::format("internal: unexpected weight name {}", name));
}

// Calls fill(spec, destination floats) for every tensor of the model, in llama_weight_specs order.
LlamaWeights build_weights(const ModelConfig& config,
                           const std::function<void(const WeightSpec&, std::span<float>)>& fill) {
  validate_model_config(config, config.name);  // dims bounded: the products below fit
  check_allocation(
      static_cast<std::uint64_t>(config.parameter_count()) * sizeof(float),
      fmt::format("the fp32 weights of {} ({} parameters)", config.name, config.parameter_count()));
  LlamaWeights w;
  w.config = config;
  w.embedding.resize(config.vocab_size, config.hidden_size);
  w.final_norm.resize(config.hidden_size);
  if (!config.tie_word_embeddings) w.lm_head.resize(config.vocab_size, config.hidden_size);
  w.layers.resize(static_cast<std::size_t>(config.num_hidden_layers));
  for (auto& layer : w.layers) size_layer(config, layer);
  for (const auto& spec : llama_weight_specs(config)) fill(spec, tensor_of(w, spec.name));
  return w;
}

}  // namespace

LlamaWeights load_llama_weights(const std::filesystem::path& directory) {
  if (directory.extension() == ".gguf" && std::filesystem::is_regular_file(directory)) {
    const GgufFile file = GgufFile::open(directory);
    const ModelConfig config = gguf_model_config(file);
    for (const auto& spec : llama_weight_specs(config)) {  // every tensor, before allocating
      const auto name = gguf_tensor_name(spec.name, config.post_norms);
      const GgufTensorInfo* tensor = name ? file.find_tensor(*name) : nullptr;
      if (tensor == nullptr || tensor->row_major_shape() != spec.shape)
        throw Error(
            fmt::format("GGUF model {}: tensor {} is missing or has another shape than "
                        "the metadata implies ({})",
                        directory.string(), name.value_or(spec.name), shape_to_string(spec.shape)));
    }
    return build_weights(config, [&](const WeightSpec& spec, std::span<float> destination) {
      read_gguf_tensor(file, config, spec.name, spec.shape, destination);
    });
  }
  if (!std::filesystem::is_directory(directory))
    throw Error(
        fmt::format("model folder {} does not exist (expected config.json and model.safetensors)",
                    directory.string()));
  ModelConfig config = load_model_config(directory / "config.json");
  config.name = directory.string();
  const Checkpoint checkpoint = Checkpoint::open(directory);
  validate_model_config(config, config.name);
  // Every tensor is where the config says, with its shape, before the fp32 copy is allocated:
  // a config that claims a larger model than the checkpoint holds fails here, not in malloc.
  for (const auto& spec : llama_weight_specs(config))
    checkpoint.check_tensor(spec.name, spec.shape);
  return build_weights(config, [&](const WeightSpec& spec, std::span<float> destination) {
    checkpoint.read_f32_into(spec.name, spec.shape, destination);
  });
}

LlamaWeights random_llama_weights(const ModelConfig& config, std::uint64_t seed) {
  if (config.size_only)
    throw Error(
        fmt::format("preset \"{}\" is size-only ({:.1f}B parameters): use it with `kvlab memory`; "
                    "runnable presets are tiny, stories15m, stories110m, gemma3-tiny and mla-tiny",
                    config.name, static_cast<double>(config.parameter_count()) / 1e9));
  validate_model_config(config, config.name);
  return build_weights(config, [&](const WeightSpec& spec, std::span<float> destination) {
    const auto values = random_tensor_values(spec, seed);
    std::copy(values.begin(), values.end(), destination.begin());
  });
}

ModelWeightsView weights_view(const LlamaWeights& weights, std::string source) {
  ModelWeightsView view;
  view.config = weights.config;
  view.embedding = matrix_view(weights.embedding);
  for (const LayerWeights& l : weights.layers)
    view.layers.push_back({vector_view(l.attention_norm), matrix_view(l.w_qkv), matrix_view(l.wo),
                           vector_view(l.mlp_norm), matrix_view(l.w_gate_up), matrix_view(l.w_down),
                           vector_view(l.q_norm), vector_view(l.k_norm),
                           vector_view(l.attention_post_norm), vector_view(l.mlp_post_norm),
                           vector_view(l.kv_a_norm), matrix_view(l.w_kv_b)});
  view.final_norm = vector_view(weights.final_norm);
  view.output_projection = matrix_view(weights.output_projection());
  view.source = std::move(source);
  return view;
}

}  // namespace kvlab::cpu
