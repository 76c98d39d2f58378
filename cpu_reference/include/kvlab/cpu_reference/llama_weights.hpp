#pragma once
// fp32 weights of a LLaMA-family model, held as Eigen matrices in Hugging Face layout.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cstdint>
#include <filesystem>
#include <vector>

#include "kvlab/model_config.hpp"
#include "kvlab/model_weights.hpp"

namespace kvlab::cpu {

// Row-major like the checkpoint: a Linear weight is (out_features, in_features).
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The projections that read the same input are stored stacked, so each is one GEMM over the
// batch (as vLLM's QKVParallelLinear / MergedColumnParallelLinear do); the accessors give the
// checkpoint's individual matrices as row blocks (contiguous: the storage is row-major).
struct LayerWeights {
  std::int64_t q_dim = 0;   // n_heads * head_dim
  std::int64_t kv_dim = 0;  // n_kv_heads * head_dim
  std::int64_t ffn_dim = 0;

  Eigen::VectorXf attention_norm;  // (dim)                          input_layernorm
  RowMatrix w_qkv;                 // (q_dim + 2 kv_dim, dim)        q_proj; k_proj; v_proj rows
  RowMatrix wo;                    // (dim, q_dim)                   o_proj
  Eigen::VectorXf mlp_norm;        // (dim)                          post_attention_layernorm
  RowMatrix w_gate_up;             // (2 ffn, dim)                   gate_proj; up_proj rows
  RowMatrix w_down;                // (dim, ffn)                     down_proj
  // Gemma 3 only (empty otherwise): per-head Q and K norms, and the norms after the attention
  // and after the MLP (mlp_norm is then pre_feedforward_layernorm). From GGUF they hold
  // Gemma's 1 + w already, so every norm here is a plain RMSNorm gain.
  Eigen::VectorXf q_norm, k_norm;       // (head_dim)                self_attn.q_norm, k_norm
  Eigen::VectorXf attention_post_norm;  // (dim)                     post_attention_layernorm
  Eigen::VectorXf mlp_post_norm;        // (dim)                     post_feedforward_layernorm
  // Latent attention (MLA) only (empty otherwise; kv_dim 0): w_qkv holds q_proj then
  // kv_a_proj_with_mqa (q_dim + latent_dim rows), wo is (dim, heads x v_head_dim).
  Eigen::VectorXf kv_a_norm;  // (kv_lora_rank)                    self_attn.kv_a_layernorm
  RowMatrix w_kv_b;           // (heads (nope + v), kv_lora_rank)  self_attn.kv_b_proj

  auto wq() { return w_qkv.topRows(q_dim); }                        // (q_dim, dim), HF row order
  auto wk() { return w_qkv.middleRows(q_dim, kv_dim); }             // (kv_dim, dim), HF row order
  auto wv() { return w_qkv.bottomRows(kv_dim); }                    // (kv_dim, dim)
  auto w_kv_a() { return w_qkv.bottomRows(w_qkv.rows() - q_dim); }  // (latent_dim, dim)
  auto w_gate() { return w_gate_up.topRows(ffn_dim); }              // (ffn, dim)
  auto w_up() { return w_gate_up.bottomRows(ffn_dim); }             // (ffn, dim)
  auto wq() const { return w_qkv.topRows(q_dim); }
  auto wk() const { return w_qkv.middleRows(q_dim, kv_dim); }
  auto wv() const { return w_qkv.bottomRows(kv_dim); }
  auto w_kv_a() const { return w_qkv.bottomRows(w_qkv.rows() - q_dim); }
  auto w_gate() const { return w_gate_up.topRows(ffn_dim); }
  auto w_up() const { return w_gate_up.bottomRows(ffn_dim); }
};

struct LlamaWeights {
  ModelConfig config;
  RowMatrix embedding;  // (vocab, dim)   embed_tokens
  std::vector<LayerWeights> layers;
  Eigen::VectorXf final_norm;  // (dim)
  RowMatrix lm_head;           // (vocab, dim); empty when tie_word_embeddings

  // (vocab, dim): lm_head, or the embedding when tied.
  const RowMatrix& output_projection() const {
    return config.tie_word_embeddings ? embedding : lm_head;
  }
};

// (rows, cols) of a row-major matrix's storage, and back: no copies.
inline WeightMatrixView matrix_view(const RowMatrix& m) {
  return {m.data(), m.rows(), m.cols()};
}
inline std::span<const float> vector_view(const Eigen::VectorXf& v) {
  return {v.data(), static_cast<std::size_t>(v.size())};
}
inline Eigen::Map<const RowMatrix> as_matrix(const WeightMatrixView& m) {
  return {m.data, m.rows, m.cols};
}
inline Eigen::Map<const Eigen::VectorXf> as_vector(std::span<const float> v) {
  return {v.data(), static_cast<Eigen::Index>(v.size())};
}

// The checkpoint as the core's view a backend is given (PluginContext::weights): pointers into
// `weights`, which must outlive it. `source`: the file or folder it was read from, "" for none.
ModelWeightsView weights_view(const LlamaWeights& weights, std::string source = "");

// Reads <directory>/config.json and its safetensors weights (single file or sharded), checking
// every tensor's presence and shape against the config. Throws kvlab::Error.
LlamaWeights load_llama_weights(const std::filesystem::path& directory);

// The same values `kvlab model init --seed` writes as f32, built in memory.
// Throws kvlab::Error for size-only presets.
LlamaWeights random_llama_weights(const ModelConfig& config, std::uint64_t seed);

}  // namespace kvlab::cpu
