#pragma once
// The LLaMA-family model description, read from a Hugging Face config.json
// (LlamaForCausalLM / MistralForCausalLM), a GGUF file (llama, gemma3) or taken from a built-in
// preset.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

// How RoPE's frequencies are rescaled for a longer context, as transformers' `rope_type`
// (config.json `rope_parameters` in transformers >= 5, `rope_scaling` before). Each type here
// leaves the attention scale at 1; any other type is refused when a config is read.
struct RopeScaling {
  enum class Type { none, linear, llama3 };
  Type type = Type::none;  // none = transformers' "default": plain RoPE
  double factor = 1.0;     // linear: every frequency / factor; llama3: low frequencies / factor
  // llama3 (Llama 3.1+): wavelengths longer than original / low_freq_factor are divided by
  // factor, shorter than original / high_freq_factor kept, and the band between interpolated.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};
// "default", "linear", "llama3": the name transformers uses for `type`.
const char* rope_type_name(RopeScaling::Type type);

struct ModelConfig {
  std::string name;  // preset name or the folder it was read from (for messages)
  std::string architecture = "LlamaForCausalLM";
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;        // dim
  std::int64_t intermediate_size = 0;  // SwiGLU hidden width
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;  // hidden_size / num_attention_heads unless config.json sets it
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  std::int32_t bos_token_id = 1;
  std::vector<std::int32_t> eos_token_ids{2};
  std::optional<std::int64_t> sliding_window;  // Mistral: attend to the last W positions only

  // Gemma 3 (Gemma3ForCausalLM, read from its GGUF): local:global layers, their own RoPE bases,
  // extra norms, GeGLU. The defaults are LLaMA's, so a LLaMA config leaves all of them alone.
  // Layer l attends to every position when (l + 1) % global_layer_every == 0 and to the last
  // local_window positions otherwise (llama.cpp's swa pattern 6: layers 5, 11, 17 global).
  // sliding_window stays empty for such a model: it is every layer's window, and here no
  // single window holds for every layer.
  std::int64_t global_layer_every = 0;  // 0: no local layers
  std::int64_t local_window = 0;
  double rope_local_theta = 0;  // the local layers' RoPE base (no scaling); 0: rope_theta
  double embedding_scale = 1;   // the embedding's rows times this (Gemma: sqrt(hidden_size))
  double query_scale = 0;       // scores' scale; 0: 1 / sqrt(head_dim)
  bool qk_norm = false;         // RMSNorm of every Q and K head before RoPE (head_dim weights)
  // RMSNorm of the attention's and of the MLP's output before each residual add (Gemma 2/3's
  // post_attention_layernorm and post_feedforward_layernorm).
  bool post_norms = false;
  enum class Activation { silu, gelu_tanh };  // SwiGLU (LLaMA) or GeGLU, tanh GELU (Gemma)
  Activation activation = Activation::silu;
  // Multi-head latent attention (MLA: DeepSeek-V2/V3, DeepseekV2ForCausalLM): kv_lora_rank > 0.
  // A token's keys and values are rebuilt from a latent c = RMSNorm(W_kv_a x) of kv_lora_rank
  // values and one RoPE key of qk_rope_head_dim shared by every head (W_kv_a's other rows); the
  // cache holds those two only (latent_dim() values a token a layer). Per head h,
  // k_h = [W_uk,h c ; k_rope] and v_h = W_uv,h c (kv_b_proj's rows); q_h = [q_nope ; q_rope]
  // from q_proj (or q_a_proj, its norm and q_b_proj when q_lora_rank > 0: V2/V3, size-only here).
  // head_dim is then qk_nope_head_dim + qk_rope_head_dim (queries' and keys'), and
  // num_key_value_heads equals the query heads (each head its own rebuilt K and V).
  std::int64_t kv_lora_rank = 0;
  std::int64_t q_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  // DeepSeekMoE (size-only presets: parameters, FLOPs and the bytes a step reads; kvlab runs
  // dense MLPs only). Layers from first_dense_layers on replace the dense MLP (intermediate_size)
  // by routed_experts experts of expert_intermediate_size, experts_per_token of them a token,
  // plus shared_experts every token passes through, and a router (hidden x routed_experts).
  struct Experts {
    std::int64_t routed = 0;  // 0: every layer's MLP dense
    std::int64_t per_token = 0;
    std::int64_t shared = 0;
    std::int64_t intermediate_size = 0;
    std::int64_t first_dense_layers = 0;
  };
  Experts experts;
  // Size-only presets describe real models for memory arithmetic; kvlab does not run them.
  bool size_only = false;

  std::int64_t group_size() const { return num_attention_heads / num_key_value_heads; }
  std::int64_t q_dim() const { return num_attention_heads * head_dim; }
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  bool is_mla() const { return kv_lora_rank > 0; }
  // Values RoPE rotates in a query (and key) head: head_dim, or MLA's qk_rope_head_dim (the
  // last ones of each head).
  std::int64_t rope_dim() const { return is_mla() ? qk_rope_head_dim : head_dim; }
  // A value head's width (MLA: v_head_dim) and all of them: o_proj's input.
  std::int64_t value_head_dim() const { return is_mla() ? v_head_dim : head_dim; }
  std::int64_t attention_output_dim() const { return num_attention_heads * value_head_dim(); }
  // MLA's cached values a token a layer: the latent and the shared RoPE key.
  std::int64_t latent_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  // The KV cache's rows: a token holds a K row and a V row of cache_kv_heads() x
  // cache_head_dim() values in every layer (KvPoolShape). MLA's latent is split over them: the
  // K row holds its first half, the V row its second (one head of latent_dim() / 2 each), so a
  // slot's bytes are exactly the latent's.
  std::int64_t cache_kv_heads() const { return is_mla() ? 1 : num_key_value_heads; }
  std::int64_t cache_head_dim() const { return is_mla() ? latent_dim() / 2 : head_dim; }
  bool has_experts() const { return experts.routed > 0; }
  bool is_expert_layer(std::int64_t layer) const {
    return has_experts() && layer >= experts.first_dense_layers;
  }
  bool is_eos(std::int32_t token) const;
  // Layer `layer`'s window: local_window for a local layer of a local:global model,
  // sliding_window (or none) otherwise.
  std::optional<std::int64_t> layer_window(std::int64_t layer) const;
  // Layer `layer`'s RoPE base: rope_local_theta for a local layer, rope_theta otherwise.
  double layer_rope_theta(std::int64_t layer) const;
  bool is_local_layer(std::int64_t layer) const {
    return global_layer_every > 0 && (layer + 1) % global_layer_every != 0;
  }
  bool is_gemma3() const { return architecture == "Gemma3ForCausalLM"; }

  // One layer's attention matrices (q, K/V or MLA's kv_a and kv_b, o) and its MLP's: all of
  // them, or the ones a token multiplies (its experts' and the shared ones).
  std::int64_t attention_parameter_count() const;
  std::int64_t mlp_parameter_count(std::int64_t layer, bool active_only) const;

  // Parameters of the model (embedding, every layer, final norm, lm_head unless tied).
  std::int64_t parameter_count() const;
  // Parameters touched by matmuls for one token (excludes the embedding lookup and norms;
  // includes the output projection; a mixture of experts' active experts only) — FLOPs per token
  // of the dense part = 2 x this.
  std::int64_t matmul_parameter_count() const;
};

// FLOPs of a full-recompute forward over `tokens` positions, causal attention counted for the
// (t+1) keys each position sees (capped by the sliding window), output logits for
// `logit_positions` positions. Multiply-add = 2 FLOPs.
double forward_flops(const ModelConfig& config, std::int64_t tokens, std::int64_t logit_positions);

// RoPE's inverse frequencies, one per rotated pair (rope_dim() / 2): theta^(-2i/d), then the
// config's scaling (transformers' `_compute_*_parameters`). The one home of the formula: the CPU
// reference, the CPU backend and the CUDA backend all build their tables from it.
std::vector<double> rope_inverse_frequencies(const ModelConfig& config);

// Reads and validates <dir>/config.json (or a path to a .json file). Throws kvlab::Error.
ModelConfig load_model_config(const std::filesystem::path& path);
// Parses config.json text; `source` names it in error messages. Throws kvlab::Error.
ModelConfig parse_model_config(std::string_view json_text, std::string_view source);
// Hugging Face config.json text for `config` (what `kvlab model init` writes); torch_dtype
// records the dtype of the weights next to it ("float32", "float16", "bfloat16").
std::string model_config_to_json(const ModelConfig& config,
                                 std::string_view torch_dtype = "float32");

// Throws kvlab::Error listing every problem with `config` (heads not divisible by KV heads, ...).
void validate_model_config(const ModelConfig& config, std::string_view source);

// Built-in presets: tiny, stories15m, stories110m (runnable) and llama-7b, llama-13b,
// llama-65b, llama2-70b, mistral-7b (size-only). Throws kvlab::Error with the list and the
// nearest name for an unknown one.
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

}  // namespace kvlab
