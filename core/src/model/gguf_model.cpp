#include "kvlab/model/gguf_model.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/model/safetensors.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {
namespace {

// Collects every problem with the metadata, like the config.json reader.
class MetadataReader {
 public:
  MetadataReader(const GgufFile& file, std::vector<std::string>& problems)
      : file_(file), problems_(problems) {}
  std::optional<std::int64_t> integer(const std::string& key, bool required) {
    const GgufValue* v = file_.find_metadata(key);
    if (v == nullptr) return missing(key, required);
    if (auto i = v->as_int()) return i;
    problems_.push_back(fmt::format("\"{}\" must be an integer, got {}", key, v->to_string()));
    return std::nullopt;
  }
  std::optional<double> number(const std::string& key, bool required) {
    const GgufValue* v = file_.find_metadata(key);
    if (v == nullptr) return missing(key, required);
    if (auto d = v->as_double()) return d;
    problems_.push_back(fmt::format("\"{}\" must be a number, got {}", key, v->to_string()));
    return std::nullopt;
  }

  void problem(std::string text) { problems_.push_back(std::move(text)); }

 private:
  std::nullopt_t missing(const std::string& key, bool required) {
    if (required) problems_.push_back(fmt::format("missing metadata key \"{}\"", key));
    return std::nullopt;
  }
  const GgufFile& file_;
  std::vector<std::string>& problems_;
};

std::int64_t vocabulary_size(const GgufFile& file, MetadataReader& read, const std::string& arch) {
  if (auto n = read.integer(arch + ".vocab_size", false)) return *n;
  if (const GgufValue* tokens = file.find_metadata("tokenizer.ggml.tokens"))
    if (const GgufArray* list = tokens->as_array()) return static_cast<std::int64_t>(list->size());
  if (const GgufTensorInfo* embedding = file.find_tensor("token_embd.weight"))
    if (embedding->dims.size() == 2) return embedding->dims[1];
  return 0;
}

// RoPE scaling is not read from GGUF: every key that would change RoPE in llama.cpp
// (ARCH.rope.scaling.type/factor/attn_factor/original_context_length, the older
// llama.rope.scale_linear, a rope_freqs tensor) is refused by name unless its value leaves RoPE
// as it is (type "none", a factor of 0 or 1, attn_factor 1).
void rope_scaling_problems(const GgufFile& file, const std::string& arch,
                           std::vector<std::string>& problems) {
  for (const auto& [key, value] : file.metadata()) {
    if (!key.starts_with(arch + ".rope.scal")) continue;
    const std::string name = "llama" + key.substr(arch.size());  // the same keys, any prefix
    const std::string* text = value.as_string();
    const std::optional<double> number = value.as_double();
    const bool identity = name == "llama.rope.scaling.type" ? text != nullptr && *text == "none"
                          : name == "llama.rope.scaling.attn_factor" ? number && *number == 1.0
                          : name == "llama.rope.scaling.factor" || name == "llama.rope.scale_linear"
                              ? number && (*number == 0.0 || *number == 1.0)
                              : false;
    if (!identity)
      problems.push_back(fmt::format(
          "\"{}\" = {}: RoPE scaling is not read from GGUF (kvlab would compute plain RoPE "
          "where llama.cpp scales it); convert the model's config.json instead, where linear and "
          "llama3 scaling are read",
          key, value.to_string()));
  }
  if (file.find_tensor("rope_freqs.weight") != nullptr)
    problems.push_back("the rope_freqs.weight tensor (per-frequency RoPE factors) is not applied");
}

// A token id: an integer in [0, 2^31), never truncated to 32 bits.
std::optional<std::int32_t> token_id(MetadataReader& read, const std::string& key) {
  const auto id = read.integer(key, false);
  if (!id) return std::nullopt;
  if (*id < 0 || *id > std::numeric_limits<std::int32_t>::max()) {
    read.problem(fmt::format("\"{}\" = {} is not a token id (0 .. 2^31 - 1)", key, *id));
    return std::nullopt;
  }
  return static_cast<std::int32_t>(*id);
}

}  // namespace

namespace {

// Gemma 3 as llama.cpp reads it (src/models/gemma3.cpp): one global layer in every 6 (unless
// the file says otherwise), the local layers' RoPE base 10,000 unless given, the embedding
// scaled by sqrt(width), per-head Q/K norms, norms after attention and MLP, tanh-GELU GeGLU,
// queries scaled by 1/sqrt(head_dim) (llama.cpp's choice for every size but 27B, which it
// recognises by its 62 layers).
void read_gemma3(const GgufFile& file, MetadataReader& read, ModelConfig& c) {
  c.architecture = "Gemma3ForCausalLM";
  c.head_dim = read.integer("gemma3.attention.key_length", false).value_or(256);
  if (auto v = read.integer("gemma3.attention.value_length", false); v && *v != c.head_dim)
    read.problem(
        fmt::format("gemma3.attention.value_length {} differs from key_length {}", *v, c.head_dim));
  if (auto window = read.integer("gemma3.attention.sliding_window", false); window && *window > 0) {
    c.local_window = *window;
    c.global_layer_every =
        read.integer("gemma3.attention.sliding_window_pattern", false).value_or(6);
    c.rope_local_theta = read.number("gemma3.rope.freq_base_swa", false).value_or(10000.0);
  }
  if (file.find_metadata("gemma3.final_logit_softcapping") != nullptr)
    read.problem("gemma3.final_logit_softcapping: logit soft-capping is not implemented");
  c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_scale = c.num_hidden_layers == 62 && c.num_attention_heads > 0
                      ? 1.0 / std::sqrt(static_cast<double>(c.hidden_size / c.num_attention_heads))
                      : 0.0;
  c.qk_norm = true;
  c.post_norms = true;
  c.activation = ModelConfig::Activation::gelu_tanh;
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& file) {
  const std::string source = file.path().string();
  const GgufValue* architecture = file.find_metadata("general.architecture");
  if (architecture == nullptr || architecture->as_string() == nullptr)
    throw Error(fmt::format("GGUF model {}: no general.architecture string", source));
  const std::string arch = *architecture->as_string();
  if (arch != "llama" && arch != "gemma3")
    throw Error(
        fmt::format("GGUF model {}: architecture \"{}\" is not supported (kvlab runs "
                    "\"llama\" and \"gemma3\")",
                    source, arch));
  std::vector<std::string> problems;
  MetadataReader read(file, problems);
  ModelConfig c;
  c.name = source;
  c.architecture = "LlamaForCausalLM";
  const auto key = [&](const char* name) { return fmt::format("{}.{}", arch, name); };
  c.hidden_size = read.integer(key("embedding_length"), true).value_or(0);
  c.intermediate_size = read.integer(key("feed_forward_length"), true).value_or(0);
  c.num_hidden_layers = read.integer(key("block_count"), true).value_or(0);
  c.num_attention_heads = read.integer(key("attention.head_count"), true).value_or(0);
  c.num_key_value_heads =
      read.integer(key("attention.head_count_kv"), false).value_or(c.num_attention_heads);
  c.max_position_embeddings = read.integer(key("context_length"), true).value_or(0);
  c.rms_norm_eps = read.number(key("attention.layer_norm_rms_epsilon"), true).value_or(1e-5);
  c.rope_theta = read.number(key("rope.freq_base"), false).value_or(10000.0);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  if (arch == "gemma3") read_gemma3(file, read, c);
  if (auto rope_dims = read.integer(key("rope.dimension_count"), false);
      rope_dims && *rope_dims != c.head_dim)
    problems.push_back(fmt::format("{} {} differs from head_dim {}: partial RoPE is not supported",
                                   key("rope.dimension_count"), *rope_dims, c.head_dim));
  rope_scaling_problems(file, arch, problems);
  c.vocab_size = vocabulary_size(file, read, arch);
  if (auto bos = token_id(read, "tokenizer.ggml.bos_token_id")) c.bos_token_id = *bos;
  if (auto eos = token_id(read, "tokenizer.ggml.eos_token_id")) c.eos_token_ids = {*eos};
  c.tie_word_embeddings = file.find_tensor("output.weight") == nullptr;
  if (!problems.empty()) {
    std::string message = fmt::format("invalid GGUF model {}:", source);
    for (const auto& p : problems) message += "\n  - " + p;
    throw Error(message);
  }
  validate_model_config(c, source);
  return c;
}

std::optional<std::string> gguf_tensor_name(const std::string& hf_name, bool post_norms) {
  if (hf_name == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf_name == "model.norm.weight") return "output_norm.weight";
  if (hf_name == "lm_head.weight") return "output.weight";
  std::size_t layer = 0;
  char field[64] = {};
  if (std::sscanf(hf_name.c_str(), "model.layers.%zu.%63s", &layer, field) != 2)
    return std::nullopt;
  // post_attention_layernorm is LLaMA's norm before the MLP, and Gemma's after the attention.
  if (std::string_view(field) == "post_attention_layernorm.weight")
    return fmt::format("blk.{}.{}", layer,
                       post_norms ? "post_attention_norm.weight" : "ffn_norm.weight");
  static const std::pair<const char*, const char*> kFields[] = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
      {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  for (const auto& [hf, gguf] : kFields)
    if (std::string_view(field) == hf) return fmt::format("blk.{}.{}", layer, gguf);
  return std::nullopt;
}

void read_gguf_tensor(const GgufFile& file, const ModelConfig& config, const std::string& hf_name,
                      std::span<const std::int64_t> shape, std::span<float> destination) {
  const auto name = gguf_tensor_name(hf_name, config.post_norms);
  const GgufTensorInfo* tensor = name ? file.find_tensor(*name) : nullptr;
  if (tensor == nullptr)
    throw Error(fmt::format("GGUF model {} has no tensor {} (for {})", file.path().string(),
                            name.value_or("?"), hf_name));
  const auto stored = tensor->row_major_shape();
  if (!std::equal(stored.begin(), stored.end(), shape.begin(), shape.end()))
    throw Error(fmt::format("tensor \"{}\" in {} has shape {} but the model needs {}", *name,
                            file.path().string(), shape_to_string(stored), shape_to_string(shape)));
  if (destination.size() != static_cast<std::size_t>(tensor->elements))
    throw Error(fmt::format("tensor \"{}\": destination holds {} floats, tensor has {}", *name,
                            destination.size(), tensor->elements));
  std::vector<float> values = file.dequantize(*tensor);  // (rows, row_length) row-major
  // llama.cpp permutes a LLaMA's Q and K rows for its interleaved RoPE; Gemma's (NeoX RoPE, as
  // Hugging Face's) are stored as they are.
  const bool permuted = !config.is_gemma3();
  const bool is_q = permuted && hf_name.ends_with("q_proj.weight"),
             is_k = permuted && hf_name.ends_with("k_proj.weight");
  if (!is_q && !is_k) {
    std::copy(values.begin(), values.end(), destination.begin());
    return;
  }
  // Undo permute(): GGUF row h*hd + 2i + j holds Hugging Face row h*hd + j*hd/2 + i.
  const std::int64_t hd = config.head_dim, half = hd / 2, columns = shape[1];
  const std::int64_t heads = is_q ? config.num_attention_heads : config.num_key_value_heads;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < half; ++i)
      for (std::int64_t j = 0; j < 2; ++j) {
        const float* from = values.data() + (h * hd + 2 * i + j) * columns;
        float* to = destination.data() + (h * hd + j * half + i) * columns;
        std::copy(from, from + columns, to);
      }
}

}  // namespace kvlab
