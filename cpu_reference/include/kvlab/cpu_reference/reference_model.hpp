#pragma once
// The golden reference (rung 1 of the correctness ladder): a full-recompute forward of a whole
// token sequence, causal, fp32, no cache. Everything else in kvlab is checked against it.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/engine/sampling.hpp"

namespace kvlab::cpu {

struct ForwardOptions {
  bool last_position_only = false;  // logits for the last position only (generation)
  // Logits for these positions only, in this order (a long sequence of a large vocabulary:
  // Gemma's 262,144 logits a row); empty: every position (or the last, above).
  std::vector<std::int64_t> logit_positions;
  // Attend to the last W positions only in every layer; defaults to each layer's window
  // (ModelConfig::layer_window: Mistral's sliding_window, Gemma 3's local layers).
  std::optional<std::int64_t> sliding_window;
};

class ReferenceModel {
 public:
  explicit ReferenceModel(LlamaWeights weights);

  const ModelConfig& config() const { return weights_.config; }
  const LlamaWeights& weights() const { return weights_; }
  const RopeTable& rope() const { return ropes_.global(); }
  // Layer `layer`'s table: the local layers' own base on a local:global model (Gemma 3).
  const RopeTable& rope_for_layer(std::int64_t layer) const { return ropes_.for_layer(layer); }

  // tokens: (T) ids, T <= max_position_embeddings. Returns logits (T, vocab), or (1, vocab)
  // with last_position_only, or (P, vocab) for P logit_positions. Throws kvlab::Error for an
  // empty sequence, an id outside the vocabulary, a sequence longer than the context or a
  // logit position outside it.
  RowMatrix forward(std::span<const std::int32_t> tokens, const ForwardOptions& options = {}) const;

 private:
  void latent_attention(std::int64_t layer, const RowMatrix& normed,
                        std::span<const std::int32_t> positions, std::optional<std::int64_t> window,
                        RowMatrix& attention) const;
  void add_mlp(const LayerWeights& layer, RowMatrix& x, RowMatrix& normed, RowMatrix& out) const;

  LlamaWeights weights_;
  LayerRopes ropes_;
};

enum class FinishReason { eos, max_tokens, context_full };
const char* finish_reason_name(FinishReason reason);

struct GeneratedToken {
  std::int32_t token = 0;
  float logprob = 0;              // log p(token) under the model (temperature 1)
  std::vector<TokenLogprob> top;  // the top-k alternatives, when asked for
};

struct GenerationResult {
  std::vector<GeneratedToken> tokens;
  FinishReason finish_reason = FinishReason::max_tokens;
};

// Autoregressive generation by full recompute: every step runs forward() over prompt +
// generated tokens (O(S^2) — the seed's no-cache baseline, and the truth for every strategy).
// Stops on EOS (unless ignore_eos), max_tokens, or a full context. `on_token`, when set, sees
// every token as soon as it is sampled (streaming).
GenerationResult generate(const ReferenceModel& model, std::span<const std::int32_t> prompt,
                          const SamplingParams& sampling, std::int32_t top_logprobs_k = 0,
                          const std::function<void(const GeneratedToken&)>& on_token = {});

}  // namespace kvlab::cpu
