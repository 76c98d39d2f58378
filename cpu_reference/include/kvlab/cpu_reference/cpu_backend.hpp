#pragma once
// The batched CPU backend: one forward over a mixed batch — prefill chunks of some sequences
// and single decode tokens of others. Projections and MLP are GEMMs over all batch tokens;
// attention runs per sequence, reading K/V from the KV pool through the sequence's KvView.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/kv/kv_groups.hpp"
#include "kvlab/kv_pool.hpp"

namespace kvlab::cpu {

// LLaMA weights with `kv_heads` K/V heads: mean-pools groups of the checkpoint's K/V heads
// into one (fewer heads, the GQA paper's conversion) or repeats each head for its group (more
// heads: the same function, computed MHA-style). Throws kvlab::Error when neither count
// divides the other or kv_heads does not divide the query heads.
LlamaWeights convert_kv_heads(const LlamaWeights& weights, std::int64_t kv_heads);

struct AttentionGroup;  // one entry's queries of one KV head's group (cpu_backend.cpp)

class CpuBackend final : public Backend {
 public:
  // `weights` (the host's view: it must outlive the backend) must have the pool's KV head count
  // and head_dim, and every layer or one KV group's layers a slot (kvlab/kv/kv_groups.hpp: each
  // entry then brings its group_views). `window`: every layer attends to the last W positions only;
  // without it, each layer to the model's own window (ModelConfig::layer_window: Gemma 3's local
  // layers). Multiplies with `compute` (select_compute_weights, or compute_weights /
  // gguf_compute_weights of the same model, packed by with_activations or not); without it, with
  // the fp32 matrices of `weights` packed in panels.
  CpuBackend(ModelWeightsView weights, KvPool& pool, std::optional<std::int64_t> window,
             ComputeWeights compute)
      : CpuBackend(std::move(weights), pool, window,
                   std::make_shared<const ComputeWeights>(std::move(compute))) {}
  // The same matrices shared with other backends (read only: perplexity's settings side by
  // side multiply one copy).
  CpuBackend(ModelWeightsView weights, KvPool& pool, std::optional<std::int64_t> window,
             std::shared_ptr<const ComputeWeights> compute);
  CpuBackend(const LlamaWeights& weights, KvPool& pool, std::optional<std::int64_t> window,
             ComputeWeights compute)
      : CpuBackend(weights_view(weights), pool, window, std::move(compute)) {}
  CpuBackend(const LlamaWeights& weights, KvPool& pool, std::optional<std::int64_t> window)
      : CpuBackend(
            weights, pool, window,
            with_activations(compute_weights(weights, WeightFormat::f32), ActivationFormat::f32)) {}

  // The positions layer `layer` attends to: the last W, or all (nullopt).
  std::optional<std::int64_t> layer_window(std::int64_t layer) const {
    return window_ ? window_ : weights_.config.layer_window(layer);
  }

  // Runs the batch, writing each new token's K/V into its slot. Returns logits (rows, vocab)
  // for the last logit_rows tokens of each entry (BatchEntry; 1: its last), entry by entry,
  // valid until the next forward. With `logit_tokens` n > 1: for the last n tokens of each entry
  // at least (all of a shorter one; perplexity scores the second half of every chunk). Throws
  // kvlab::Error for an entry asking for more rows than it has tokens.
  const RowMatrix& run(std::span<const BatchEntry> batch, std::int64_t logit_tokens = 1);
  // After run: the attention each entry's scored queries gave its keys (ForwardResult's
  // key_scores), or empty when no entry asked.
  std::span<const float> key_scores() const { return key_scores_; }

  // Logits always: the host is where they are, so picking here saves no copy.
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> /*choices*/) override {
    const RowMatrix& logits = run(batch);
    ForwardResult result =
        ForwardResult::of_logits({logits.data(), static_cast<std::size_t>(logits.size())});
    result.key_scores = key_scores_;
    return result;
  }
  std::int64_t vocab_size() const override { return weights_.config.vocab_size; }
  // The formats its products read (ComputeWeights::description).
  std::string description() const override { return compute_->description; }

  // From this many sequences in a batch on, decode attention runs one task per sequence (its
  // slot rows read whole, in order); below, one task per (sequence, K/V head) so that a few
  // sequences still spread over the threads. The two kernels differ in speed (a cost model's
  // decode attention regimes, kvlab calibrate).
  static std::int64_t whole_entry_attention_sequences(int threads) {
    return 4 * static_cast<std::int64_t>(threads);
  }

  const ComputeWeights& matrices() const { return *compute_; }
  // Frees the activations and logits kept between runs (the next run allocates them again):
  // backends that take turns over one batch (perplexity's settings side by side) hold one
  // batch's buffers at a time instead of one each.
  void release_buffers();

 private:
  void prepare_key_scores(std::span<const BatchEntry> batch);
  const RowMatrix& logit_rows(const RowMatrix& x, std::span<const BatchEntry> batch,
                              std::span<const std::int64_t> first_rows, std::int64_t logit_tokens);
  const KvView& group_view(const BatchEntry& entry, std::int64_t group) const;
  std::int64_t group_of(std::int64_t layer) const {
    return groups_.group_of_layer[static_cast<std::size_t>(layer)];
  }
  void add_output(const RowMatrix& input, const WeightMatrix& w, std::span<const float> post_norm,
                  RowMatrix& x);
  void seal_kivi_residuals(std::span<const BatchEntry> batch);
  void rotate_and_store(std::int64_t layer, std::span<const std::int32_t> positions,
                        std::span<const std::int64_t> slots, RowMatrix& qkv);
  void attend(std::int64_t layer, std::span<const BatchEntry> batch,
              std::span<const std::int64_t> first_rows, const RowMatrix& q, RowMatrix& out);
  std::vector<std::size_t> give_score_buffers(std::span<const BatchEntry> batch,
                                              std::vector<AttentionGroup>& tasks);
  void attend_decode(std::int64_t layer, const AttentionGroup& task, const RowMatrix& q,
                     RowMatrix& out) const;
  void attend_chunk(std::int64_t layer, const AttentionGroup& task, const RowMatrix& q,
                    RowMatrix& out) const;
  void latent_attend(std::int64_t layer, std::span<const BatchEntry> batch,
                     std::span<const std::int64_t> first_rows,
                     std::span<const std::int32_t> positions, std::span<const std::int64_t> slots,
                     RowMatrix& qkv, RowMatrix& out);
  void latent_attend_entry(std::int64_t pool_layer, const BatchEntry& entry, std::int64_t row0);
  using StridedMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
  StridedMap head_rows(std::int64_t layer, std::int64_t slot, std::int64_t length,
                       std::int64_t kv_head, bool value) const;

  ModelWeightsView weights_;
  std::shared_ptr<const ComputeWeights> compute_;
  KvPool& pool_;
  KvLayerGroups groups_;                // one of every layer, or the pool's KV groups
  std::optional<std::int64_t> window_;  // every layer's, when set; else the model's per layer
  LayerRopes ropes_;
  float query_rescale_ = 1.0f;  // query_rescale(): the model's query scale over 1/sqrt(head_dim)
  // Activations, kept between steps so a decode step allocates (and page-faults) nothing.
  RowMatrix x_, normed_, qkv_, attention_, gate_up_, hidden_, block_out_, last_, logits_;
  // Latent attention: the absorbed queries (N, heads x latent_dim) and the weighted latents
  // (N, heads x kv_lora_rank).
  RowMatrix q_absorbed_, latent_out_;
  // Attention scores (BatchEntry::scored_queries): each entry's keys from score_offsets_[e],
  // summed over layers; and each task's own sums within one layer.
  std::vector<float> key_scores_, task_scores_;
  std::vector<std::size_t> score_offsets_;
  // A layer of a KV group other than 0 under a KV policy: each entry's view in that group
  // matched to its view (group 0's, which the key mask and the scores number), and the layer's
  // key mask in the group view's numbering.
  struct GroupKeys {
    std::vector<std::int64_t> index;  // (group view length) each key's index in entry.view
    std::vector<std::uint8_t> mask;   // (kv_heads, group view length), or empty
  };
  std::vector<GroupKeys> group_keys_;  // (entries)
  void match_group_keys(std::int64_t layer, std::span<const BatchEntry> batch);
  void add_task_scores(std::int64_t layer, std::span<const BatchEntry> batch,
                       std::span<const AttentionGroup> tasks,
                       std::span<const std::size_t> task_entries, bool matched);
};

}  // namespace kvlab::cpu
