#pragma once
// fp32 weights of a LLaMA-family model, held as Eigen matrices in Hugging Face layout.
#include <Eigen/Core>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "kvlab/model_config.hpp"

namespace kvlab::cpu {

// Row-major like the checkpoint: a Linear weight is (out_features, in_features).
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct LayerWeights {
  Eigen::VectorXf attention_norm;  // (dim)                   input_layernorm
  RowMatrix wq;                    // (n_heads * head_dim, dim)     q_proj, HF row order
  RowMatrix wk;                    // (n_kv_heads * head_dim, dim)  k_proj, HF row order
  RowMatrix wv;                    // (n_kv_heads * head_dim, dim)  v_proj
  RowMatrix wo;                    // (dim, n_heads * head_dim)     o_proj
  Eigen::VectorXf mlp_norm;        // (dim)                   post_attention_layernorm
  RowMatrix w_gate;                // (ffn, dim)              gate_proj
  RowMatrix w_up;                  // (ffn, dim)              up_proj
  RowMatrix w_down;                // (dim, ffn)              down_proj
};

struct LlamaWeights {
  ModelConfig config;
  RowMatrix embedding;  // (vocab, dim)   embed_tokens
  std::vector<LayerWeights> layers;
  Eigen::VectorXf final_norm;  // (dim)
  RowMatrix lm_head;           // (vocab, dim); empty when tie_word_embeddings

  // (vocab, dim): lm_head, or the embedding when tied.
  const RowMatrix& output_projection() const { return config.tie_word_embeddings ? embedding : lm_head; }
};

// Reads <directory>/config.json and its safetensors weights (single file or sharded), checking
// every tensor's presence and shape against the config. Throws kvlab::Error.
LlamaWeights load_llama_weights(const std::filesystem::path& directory);

// The same values `kvlab model init --seed` writes as f32, built in memory.
// Throws kvlab::Error for size-only presets.
LlamaWeights random_llama_weights(const ModelConfig& config, std::uint64_t seed);

}  // namespace kvlab::cpu
