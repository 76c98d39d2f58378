#pragma once
// The building blocks of the LLaMA forward, one formula each, shared by the full-recompute
// reference and (later) the batched CPU backend.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cstdint>
#include <optional>
#include <span>

#include "kvlab/cpu_reference/llama_weights.hpp"

namespace kvlab::cpu {

// Threads used by Eigen's GEMMs and kvlab's OpenMP loops (default: all cores); a request is
// clamped to [1, processors].
void set_num_threads(int threads);
int num_threads();

// y (+)= x w^T, the projection of every batch row: x (M, K), w (N, K) as stored, y (M, N).
// Up to 16 rows (decode batches): each thread streams 4 rows of w at a time once and multiplies
// them with all of x in an AVX2 2x4 register tile, no packing; more rows: a BLAS GEMM.
void multiply_by_transposed(const RowMatrix& x, const RowMatrix& w, RowMatrix& y, bool accumulate);

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, for every row t.
// x: (T, dim), weight: (dim), out: (T, dim); out may alias x.
void rms_norm(const RowMatrix& x, Eigen::Ref<const Eigen::VectorXf> weight, float eps,
              RowMatrix& out);

// Every `head_dim` values of every row normalised on their own (Gemma 3's Q and K norms):
// rows: (T, heads * head_dim) in place, weight: (head_dim).
void rms_norm_heads(RowMatrix& rows, Eigen::Ref<const Eigen::VectorXf> weight, float eps);
// The same for one row: `heads` consecutive heads of weight.size() values at `row`, in place.
void rms_norm_row_heads(float* row, std::int64_t heads, Eigen::Ref<const Eigen::VectorXf> weight,
                        float eps);

// The MLP's gated activation: hidden[t] = act(gate[t]) * up[t], gate_up: (T, 2 ffn) with the gate
// first, hidden: (T, ffn). act: SiLU (SwiGLU: LLaMA) or tanh-approximated GELU (GeGLU: Gemma,
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).
void gated_activation(const RowMatrix& gate_up, std::int64_t ffn,
                      ModelConfig::Activation activation, RowMatrix& hidden);

// x <- H x for `heads` consecutive heads of `head_dim` values (a power of two), H the
// orthonormal Walsh-Hadamard matrix (symmetric, H H = I: the same call rotates back). A fast
// transform: head_dim log2(head_dim) additions per head.
void hadamard_rotate(float* x, std::int64_t heads, std::int64_t head_dim);

// Rotary position embedding in the Hugging Face convention ("rotate half"): within a head of
// size d, dimension i (< d/2) pairs with i + d/2, rotated by angle pos * theta^(-2i/d):
//   x'[i]       = x[i] cos - x[i + d/2] sin
//   x'[i + d/2] = x[i + d/2] cos + x[i] sin
// The angle of pair i is pos * inverse_frequency[i]: theta^(-2i/d) for plain RoPE, rescaled
// for linear / llama3 RoPE by kvlab::rope_inverse_frequencies.
class RopeTable {
 public:
  // The model's RoPE (theta and scaling) for positions [0, max_position_embeddings).
  explicit RopeTable(const ModelConfig& config);
  // Plain RoPE with `theta` (no scaling).
  RopeTable(std::int64_t head_dim, double theta, std::int64_t max_positions);
  // inverse_frequencies: (head_dim / 2).
  RopeTable(std::span<const double> inverse_frequencies, std::int64_t max_positions);
  // rows: (T, n_heads * head_dim), positions: (T). Rotates every head of every row in place
  // (rows split over the threads when there are many).
  void apply(RowMatrix& rows, std::span<const std::int32_t> positions, std::int64_t n_heads) const;
  // row: (n_heads * head_dim) at `position`, rotated in place.
  void apply_row(float* row, std::int32_t position, std::int64_t n_heads) const;
  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t max_positions() const { return cos_.rows(); }
  float cos(std::int64_t position, std::int64_t i) const { return cos_(position, i); }
  float sin(std::int64_t position, std::int64_t i) const { return sin_(position, i); }

 private:
  std::int64_t head_dim_;
  RowMatrix cos_;  // (max_positions, head_dim / 2), angles computed in double
  RowMatrix sin_;  // (max_positions, head_dim / 2)
};

// The RoPE table of each layer: the model's, and on a local:global model (Gemma 3) the local
// layers' own (rope_local_theta, no scaling).
class LayerRopes {
 public:
  explicit LayerRopes(const ModelConfig& config);
  const RopeTable& for_layer(std::int64_t layer) const {
    return local_ && (layer + 1) % global_layer_every_ != 0 ? *local_ : global_;
  }
  const RopeTable& global() const { return global_; }

 private:
  RopeTable global_;
  std::optional<RopeTable> local_;
  std::int64_t global_layer_every_ = 0;
};

// What queries are multiplied by on top of the attention's 1/sqrt(head_dim) so that scores are
// scaled by ModelConfig::query_scale: query_scale x sqrt(head_dim); 1 without one.
float query_rescale(const ModelConfig& config);

// Causal self-attention over one whole sequence, with grouped KV heads: query head h reads KV
// head h / (n_heads / n_kv_heads). Position i attends to keys j with j <= i and, with a
// window W, i - j < W. Softmax in fp32 with the row max subtracted.
// Scores scaled by 1/sqrt(head_dim); values may be of another width (MLA's v_head_dim).
// q: (T, n_heads * head_dim)  k: (T, n_kv_heads * head_dim)  v: (T, n_kv_heads * value_dim)
// out: (T, n_heads * value_dim)
void causal_attention(const RowMatrix& q, const RowMatrix& k, const RowMatrix& v,
                      std::int64_t n_heads, std::int64_t n_kv_heads,
                      std::optional<std::int64_t> window, RowMatrix& out);

}  // namespace kvlab::cpu
