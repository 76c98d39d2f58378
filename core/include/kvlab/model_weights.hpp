#pragma once
// The weights a backend computes with: a read-only view of a LLaMA-family checkpoint in fp32,
// Hugging Face layout, owned by whoever loaded it (the host). Backends are handed this through
// PluginContext::weights, never a loader's own type: the cpu backend multiplies it (or the
// file's stored formats, found through `source`), the cuda backend uploads it.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvlab/model_config.hpp"

namespace kvlab {

// A row-major fp32 matrix someone else owns: (rows, cols), row r at data + r * cols.
struct WeightMatrixView {
  const float* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;

  std::span<const float> values() const { return {data, static_cast<std::size_t>(rows * cols)}; }
  std::span<const float> row(std::int64_t r) const {
    return {data + r * cols, static_cast<std::size_t>(cols)};
  }
};

// One decoder layer. The projections that read the same input are stacked (one GEMM each):
// w_qkv is q_proj; k_proj; v_proj by rows, w_gate_up is gate_proj; up_proj.
struct LayerWeightsView {
  std::span<const float> attention_norm;  // (dim)                    input_layernorm
  WeightMatrixView w_qkv;                 // (q_dim + 2 kv_dim, dim)
  WeightMatrixView wo;                    // (dim, q_dim)             o_proj
  std::span<const float> mlp_norm;        // (dim)                    post_attention_layernorm
  WeightMatrixView w_gate_up;             // (2 ffn, dim)
  WeightMatrixView w_down;                // (dim, ffn)               down_proj
  // Gemma 3 only (empty otherwise): per-head Q and K norms; norms after the attention and the
  // MLP (mlp_norm is then pre_feedforward_layernorm). Plain RMSNorm gains (GGUF holds 1 + w).
  std::span<const float> q_norm, k_norm;                      // (head_dim)
  std::span<const float> attention_post_norm, mlp_post_norm;  // (dim)
  // Latent attention (MLA) only (empty otherwise): w_qkv is then q_proj; kv_a_proj_with_mqa by
  // rows, (q_dim + latent_dim, dim), and wo (dim, heads x v_head_dim). The latent's norm and
  // kv_b_proj, (heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank): per head W_uk's rows
  // then W_uv's.
  std::span<const float> kv_a_norm;  // (kv_lora_rank)            self_attn.kv_a_layernorm
  WeightMatrixView w_kv_b;
};

struct ModelWeightsView {
  ModelConfig config;          // the served model's (K/V heads as converted)
  WeightMatrixView embedding;  // (vocab, dim)   embed_tokens
  std::vector<LayerWeightsView> layers;
  std::span<const float> final_norm;   // (dim)
  WeightMatrixView output_projection;  // (vocab, dim)   lm_head, or the embedding when tied
  // The checkpoint these values came from: a .gguf file (whose stored formats a backend may
  // multiply directly), a safetensors folder, or "" for weights built in memory (a preset).
  std::string source;
};

}  // namespace kvlab
