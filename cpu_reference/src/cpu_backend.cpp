#include "kvlab/cpu_reference/cpu_backend.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cstring>
#include <limits>

#include "attention_rows.hpp"
#include "kivi_attention.hpp"
#include "kvlab/error.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {

LlamaWeights convert_kv_heads(const LlamaWeights& weights, std::int64_t kv_heads) {
  const ModelConfig& c = weights.config;
  const std::int64_t old_heads = c.num_key_value_heads;
  if (kv_heads == old_heads) return weights;
  if (kv_heads <= 0 || c.num_attention_heads % kv_heads != 0 ||
      (kv_heads < old_heads ? old_heads % kv_heads : kv_heads % old_heads) != 0)
    throw Error(fmt::format(
        "cannot convert {} from {} to {} K/V heads: the counts must divide each other and the {} "
        "query heads",
        c.name, old_heads, kv_heads, c.num_attention_heads));
  LlamaWeights out = weights;
  out.config.num_key_value_heads = kv_heads;
  const std::int64_t hd = c.head_dim, dim = c.hidden_size;
  // (old_heads * hd, dim) -> (kv_heads * hd, dim), row block per head.
  auto convert = [&](const auto& source) {
    RowMatrix result(kv_heads * hd, dim);
    for (std::int64_t h = 0; h < kv_heads; ++h) {
      if (kv_heads < old_heads) {  // mean of the group's heads
        const std::int64_t group = old_heads / kv_heads;
        result.middleRows(h * hd, hd).setZero();
        for (std::int64_t g = 0; g < group; ++g)
          result.middleRows(h * hd, hd) += source.middleRows((h * group + g) * hd, hd);
        result.middleRows(h * hd, hd) /= static_cast<float>(group);
      } else {  // repeat: new head h reads old head h / (kv_heads / old_heads)
        result.middleRows(h * hd, hd) = source.middleRows((h / (kv_heads / old_heads)) * hd, hd);
      }
    }
    return result;
  };
  for (std::size_t l = 0; l < weights.layers.size(); ++l) {
    const LayerWeights& source = weights.layers[l];
    LayerWeights& layer = out.layers[l];
    const RowMatrix wk = convert(source.wk()), wv = convert(source.wv());
    layer.kv_dim = kv_heads * hd;
    layer.w_qkv.resize(layer.q_dim + 2 * layer.kv_dim, dim);
    layer.wq() = source.wq();
    layer.wk() = wk;
    layer.wv() = wv;
  }
  return out;
}

CpuBackend::CpuBackend(ModelWeightsView weights, KvPool& pool, std::optional<std::int64_t> window,
                       std::shared_ptr<const ComputeWeights> compute)
    : weights_(std::move(weights)),
      compute_(std::move(compute)),
      pool_(pool),
      window_(window),
      ropes_(weights_.config),
      query_rescale_(query_rescale(weights_.config)) {
  const ModelConfig& c = weights_.config;
  for (const LayerWeightsView& layer : weights_.layers)
    if (c.qk_norm && (static_cast<std::int64_t>(layer.q_norm.size()) != c.head_dim ||
                      static_cast<std::int64_t>(layer.k_norm.size()) != c.head_dim))
      throw Error(
          fmt::format("internal: {} normalises Q and K per head but a layer's Q/K norms "
                      "are not of head_dim {}",
                      c.name, c.head_dim));
  if (compute_->layers.size() != weights_.layers.size() ||
      compute_->output_projection.rows() != c.vocab_size)
    throw Error(fmt::format("internal: compute weights ({} layers) are not {}'s",
                            compute_->layers.size(), c.name));
  // A pool of every layer (one slot: a token in every layer), or of KV groups (one slot: a token
  // in one group's layers, kvlab/kv/kv_groups.hpp).
  groups_ = kv_layer_groups(c, pool.shape().layers != c.num_hidden_layers);
  if (pool.shape().kv_heads != c.cache_kv_heads() || pool.shape().head_dim != c.cache_head_dim() ||
      pool.shape().layers != groups_.group_layers)
    throw Error(fmt::format(
        "KV pool shape ({} layers, {} KV heads, head_dim {}) does not match the model ({}, {}, {}; "
        "or {} layers a slot in KV groups)",
        pool.shape().layers, pool.shape().kv_heads, pool.shape().head_dim, c.num_hidden_layers,
        c.cache_kv_heads(), c.cache_head_dim(), kv_layer_groups(c, true).group_layers));
  if (c.is_mla() && (pool.shape().hadamard_rotated || dtype_is_kivi(pool.shape().dtype)))
    throw Error(fmt::format(
        "{} caches a latent (latent attention): its KV pool is neither Hadamard-rotated nor a "
        "KIVI pool",
        c.name));
}

void CpuBackend::release_buffers() {
  for (RowMatrix* m : {&x_, &normed_, &qkv_, &attention_, &gate_up_, &hidden_, &block_out_, &last_,
                       &logits_, &q_absorbed_, &latent_out_})
    m->resize(0, 0);
  key_scores_ = {};
  task_scores_ = {};
}

// The entry's view in `group`: its group view with KV groups, its view otherwise.
const KvView& CpuBackend::group_view(const BatchEntry& entry, std::int64_t group) const {
  if (groups_.uniform()) return entry.view;
  if (static_cast<std::int64_t>(entry.group_views.size()) != groups_.count())
    throw Error(fmt::format("a batch entry has {} KV group views, the pool {} groups",
                            entry.group_views.size(), groups_.count()));
  return entry.group_views[static_cast<std::size_t>(group)];
}

const RowMatrix& CpuBackend::run(std::span<const BatchEntry> batch, std::int64_t logit_tokens) {
  const ModelConfig& c = weights_.config;
  std::vector<std::int64_t> first_rows;  // batch row of each entry's first token
  std::vector<std::int32_t> positions;   // of each batch row
  // (groups, batch rows): each row's K/V slot in each KV group; -1: not written
  std::vector<std::vector<std::int64_t>> slots(static_cast<std::size_t>(groups_.count()));
  std::int64_t rows = 0;
  for (const auto& e : batch) {
    if (e.logit_rows < 1 ||
        e.logit_rows > std::max<std::int64_t>(1, static_cast<std::int64_t>(e.tokens.size())))
      throw Error(fmt::format("a batch entry of {} tokens asks for logits at {} of them",
                              e.tokens.size(), e.logit_rows));
    first_rows.push_back(rows);
    for (std::size_t j = 0; j < e.tokens.size(); ++j) {
      const std::int64_t position = e.start_position + static_cast<std::int64_t>(j);
      if (position >= c.max_position_embeddings)
        throw Error(fmt::format("position {} is beyond the context of {}", position, c.name));
      if (e.tokens[j] < 0 || e.tokens[j] >= c.vocab_size)  // its embedding row would not exist
        throw Error(fmt::format("token id {} at position {} is outside {}'s vocabulary [0, {})",
                                e.tokens[j], position, c.name, c.vocab_size));
      positions.push_back(static_cast<std::int32_t>(position));
      for (std::int64_t g = 0; g < groups_.count(); ++g)
        slots[static_cast<std::size_t>(g)].push_back(
            e.writes_kv ? group_view(e, g).slot_of(position) : -1);
    }
    rows += static_cast<std::int64_t>(e.tokens.size());
  }
  first_rows.push_back(rows);
  prepare_key_scores(batch);
  const auto eps = static_cast<float>(c.rms_norm_eps);

  RowMatrix& x = x_;  // (N, dim) residual stream of every batch token
  x.resize(rows, c.hidden_size);
  for (std::size_t e = 0; e < batch.size(); ++e)
    for (std::size_t j = 0; j < batch[e].tokens.size(); ++j)
      x.row(first_rows[e] + static_cast<std::int64_t>(j)) =
          as_vector(weights_.embedding.row(batch[e].tokens[j])).transpose();
  if (c.embedding_scale != 1) x *= static_cast<float>(c.embedding_scale);  // Gemma: sqrt(dim)

  RowMatrix &normed = normed_, &qkv = qkv_, &attention = attention_, &gate_up = gate_up_,
            &hidden = hidden_;
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeightsView& layer = weights_.layers[static_cast<std::size_t>(l)];
    const LayerComputeWeights& matrices = compute_->layers[static_cast<std::size_t>(l)];
    rms_norm(x, as_vector(layer.attention_norm), eps, normed);
    multiply_by_transposed(normed, matrices.w_qkv, qkv, false);
    if (c.is_mla()) {
      latent_attend(l, batch, first_rows, positions, slots[0], qkv, attention);
    } else {
      rotate_and_store(l, positions, slots[static_cast<std::size_t>(group_of(l))], qkv);
      attend(l, batch, first_rows, qkv, attention);
    }
    if (pool_.shape().hadamard_rotated) {  // sum_j p_j H v_j = H o: back to o
      parallel_for(
          rows,
          [&](std::int64_t t) {
            hadamard_rotate(attention.row(t).data(), c.num_attention_heads, c.head_dim);
          },
          17);
    }
    add_output(attention, matrices.wo, layer.attention_post_norm, x);

    rms_norm(x, as_vector(layer.mlp_norm), eps, normed);
    multiply_by_transposed(normed, matrices.w_gate_up, gate_up, false);    // (N, 2 ffn)
    gated_activation(gate_up, c.intermediate_size, c.activation, hidden);  // (N, ffn)
    add_output(hidden, matrices.w_down, layer.mlp_post_norm, x);
  }
  seal_kivi_residuals(batch);
  const RowMatrix& last = logit_rows(x, batch, first_rows, logit_tokens);
  rms_norm(last, as_vector(weights_.final_norm), eps, normed);
  multiply_by_transposed(normed, compute_->output_projection, logits_, false);  // (.., vocab)
  return logits_;
}

// A KIVI pool's groups that left the newest kivi_residual tokens of an entry's sequence with
// this forward, sealed after it: the forward read its own tokens, and the residual, in fp16 (as
// KIVI's prefill attends in full precision). An entry's view lists a group's rows together, in
// position order: a group goes once the newest position of it the view holds is older than the
// newest R (after a KV policy's drops, a group's rows hold the positions it kept). The newest
// group goes only once its last row is written (a residual of 0).
void CpuBackend::seal_kivi_residuals(std::span<const BatchEntry> batch) {
  if (!dtype_is_kivi(pool_.shape().dtype)) return;
  for (const BatchEntry& e : batch) {
    if (!e.writes_kv) continue;
    const std::int64_t end = e.start_position + static_cast<std::int64_t>(e.tokens.size());
    const std::int64_t sealed_before = end - pool_.shape().kivi_residual;
    std::int64_t group = -1, newest = 0, last_row = 0;  // the group being read
    auto decide = [&](bool final) {
      if (group >= 0 && newest < sealed_before && (!final || last_row == kKiviGroup - 1))
        pool_.seal_open_groups(group * kKiviGroup, 1);
    };
    std::int64_t index = 0;
    for (const KvExtent& extent : e.view.extents) {
      for (std::int64_t i = 0; i < extent.length;) {
        const std::int64_t slot = extent.start_slot + i, row = slot % kKiviGroup;
        const std::int64_t in_group = std::min(kKiviGroup - row, extent.length - i);
        if (slot / kKiviGroup != group) decide(false);
        group = slot / kKiviGroup;
        newest = e.view.position_at(index + i + in_group - 1);
        last_row = row + in_group - 1;
        i += in_group;
      }
      index += extent.length;
    }
    decide(true);
  }
}

// x += input w^T, or x += RMSNorm(input w^T) when the layer has a norm after the block (Gemma's
// post-attention and post-feedforward norms: a non-empty post_norm). input: (N, w.cols()).
void CpuBackend::add_output(const RowMatrix& input, const WeightMatrix& w,
                            std::span<const float> post_norm, RowMatrix& x) {
  if (post_norm.empty()) {
    multiply_by_transposed(input, w, x, true);
    return;
  }
  multiply_by_transposed(input, w, block_out_, false);  // (N, dim)
  rms_norm(block_out_, as_vector(post_norm), static_cast<float>(weights_.config.rms_norm_eps),
           block_out_);
  x += block_out_;
}

// qkv (N, q_dim + 2 kv_dim): row t is token t's Q | K | V. Gemma's per-head norms of Q and K
// come first; RoPE rotates Q and K in place and the
// new tokens' K and V go to their slots (rounded to the pool's dtype), in one pass over the rows:
// no copies of Q and K, one join of the threads. A KIVI pool's writes come after, on one thread
// in slot order: a group's last row seals the rows before it (kvlab/kv_pool.hpp).
void CpuBackend::rotate_and_store(std::int64_t layer, std::span<const std::int32_t> positions,
                                  std::span<const std::int64_t> slots, RowMatrix& qkv) {
  const ModelConfig& c = weights_.config;
  const std::int64_t q_dim = c.q_dim(), kv_dim = c.kv_dim(), rows = qkv.rows();
  const bool kivi = dtype_is_kivi(pool_.shape().dtype);
  const LayerWeightsView& weights = weights_.layers[static_cast<std::size_t>(layer)];
  const RopeTable& rope = ropes_.for_layer(layer);
  const std::int64_t pool_layer = groups_.pool_layer[static_cast<std::size_t>(layer)];
  const auto eps = static_cast<float>(c.rms_norm_eps);
  const auto rotate_and_write = [&](std::int64_t t) {
    float* values = qkv.row(t).data();
    const auto row = static_cast<std::size_t>(t);
    if (c.qk_norm) {
      rms_norm_row_heads(values, c.num_attention_heads, as_vector(weights.q_norm), eps);
      rms_norm_row_heads(values + q_dim, c.num_key_value_heads, as_vector(weights.k_norm), eps);
    }
    rope.apply_row(values, positions[row], c.num_attention_heads);
    rope.apply_row(values + q_dim, positions[row], c.num_key_value_heads);
    if (query_rescale_ != 1.0f) Eigen::Map<Eigen::VectorXf>(values, q_dim) *= query_rescale_;
    if (pool_.shape().hadamard_rotated)  // Q, K and V of every head: scores unchanged
      hadamard_rotate(values, c.num_attention_heads + 2 * c.num_key_value_heads, c.head_dim);
    if (slots[row] < 0 || kivi) return;
    pool_.write_row(pool_layer, slots[row], false, values + q_dim);
    pool_.write_row(pool_layer, slots[row], true, values + q_dim + kv_dim);
  };
  parallel_for(rows, rotate_and_write, 17);
  for (std::int64_t t = 0; kivi && t < rows; ++t) {
    const std::int64_t slot = slots[static_cast<std::size_t>(t)];
    if (slot < 0) continue;
    pool_.write_row(pool_layer, slot, false, qkv.row(t).data() + q_dim);
    pool_.write_row(pool_layer, slot, true, qkv.row(t).data() + q_dim + kv_dim);
  }
}

// Zeroed sums for the entries that ask for attention scores, (layers, kv_heads, keys) an entry;
// none when no entry does. Checks the entries' key masks.
void CpuBackend::prepare_key_scores(std::span<const BatchEntry> batch) {
  const ModelConfig& c = weights_.config;
  const auto heads = static_cast<std::size_t>(c.num_hidden_layers * c.num_key_value_heads);
  score_offsets_.clear();
  std::size_t total = 0;
  bool asked = false, masked = false;
  for (const BatchEntry& e : batch) {
    score_offsets_.push_back(total);
    const auto keys = static_cast<std::size_t>(e.view.length());
    total += heads * keys;
    asked = asked || e.scored_queries > 0;
    masked = masked || !e.key_mask.empty();
    if (!e.key_mask.empty() && e.key_mask.size() != heads * keys)
      throw Error(
          fmt::format("a key mask of {} bytes for a view of {} keys: {} layers x {} K/V "
                      "heads x {} keys expected",
                      e.key_mask.size(), keys, c.num_hidden_layers, c.num_key_value_heads, keys));
  }
  if ((asked || masked) && c.latent_dim() > 0)
    throw Error(fmt::format("attention {} for a KV policy are not computed with latent attention",
                            asked ? "scores" : "masks"));
  if (asked)
    key_scores_.assign(total, 0.0f);
  else
    key_scores_.clear();
}

// The residual rows that get logits: the last max(logit_tokens, the entry's logit_rows) of each
// entry (all of a shorter one), entry by entry. x: (N, dim); returns (those rows, dim).
const RowMatrix& CpuBackend::logit_rows(const RowMatrix& x, std::span<const BatchEntry> batch,
                                        std::span<const std::int64_t> first_rows,
                                        std::int64_t logit_tokens) {
  const std::size_t entries = first_rows.size() - 1;
  const auto rows_of = [&](std::size_t e) {
    return std::min(std::max<std::int64_t>(logit_tokens, batch[e].logit_rows),
                    first_rows[e + 1] - first_rows[e]);
  };
  std::int64_t kept = 0;
  for (std::size_t e = 0; e < entries; ++e) kept += rows_of(e);
  last_.resize(kept, x.cols());
  kept = 0;
  for (std::size_t e = 0; e < entries; ++e) {
    const std::int64_t n = rows_of(e);
    last_.middleRows(kept, n) = x.middleRows(first_rows[e + 1] - n, n);
    kept += n;
  }
  return last_;
}

// One entry's queries for the query heads of one KV head, and the keys they may see. Keys are
// numbered by their index in the entry's view (a KV policy may have dropped positions between
// them); columns count from the first key any query sees.
struct AttentionGroup {
  const BatchEntry& entry;
  const KvView& view;                     // the entry's view in the layer's KV group
  std::int64_t kv_head, kv_count, group;  // K/V heads [kv_head, kv_head + kv_count)
  std::int64_t row0;                      // batch row of the entry's first query
  std::int64_t key_begin, key_end;        // view indices [key_begin, key_end)
  std::optional<std::int64_t> window;
  // When not null: the layer's rows of the entry's key mask (BatchEntry::key_mask), K/V head
  // h's at mask + h * view.length().
  const std::uint8_t* mask = nullptr;
  // When not null: (kv_count, keys()) where each query from `scored_from` on adds its attention
  // weights, summed over the query heads of each K/V head (BatchEntry::scored_queries).
  float* key_scores = nullptr;
  std::int64_t scored_from = 0;
  // A part of one K/V head's query heads (split_chunk_tasks): [head_begin, head_begin +
  // head_count) of its group; head_count 0: all of them.
  std::int64_t head_begin = 0, head_count = 0;
  // A block of the entry's queries (push_query_blocks): [query_begin, query_begin + query_count);
  // query_count 0: all of them. row0 and the keys are the block's.
  std::int64_t query_begin = 0, query_count = 0;

  // Their query heads: [first_head, first_head + heads); query head h reads K/V head h / group.
  std::int64_t first_head() const { return kv_head * group + head_begin; }
  std::int64_t heads() const { return head_count > 0 ? head_count : kv_count * group; }
  std::int64_t queries() const {
    return query_count > 0 ? query_count : static_cast<std::int64_t>(entry.tokens.size());
  }
  std::int64_t first_position() const { return entry.start_position + query_begin; }
  std::int64_t keys() const { return key_end - key_begin; }
  // Columns query i (position start + i) sees: [first_visible(i), last_visible(i)].
  std::int64_t first_visible(std::int64_t i) const {
    if (!window) return 0;
    const std::int64_t oldest = first_position() + i - *window + 1;
    return std::max(key_begin, view.index_at_or_after(oldest)) - key_begin;
  }
  std::int64_t last_visible(std::int64_t i) const {
    return view.index_at_or_after(first_position() + i + 1) - 1 - key_begin;
  }
  // The mask of the task's K/V head k over its columns, or null when nothing is masked.
  const std::uint8_t* column_mask(std::int64_t k) const {
    return mask == nullptr ? nullptr : mask + (kv_head + k) * view.length() + key_begin;
  }
  // Calls visit(column, first slot, length) for each run of consecutive slots holding keys
  // [key_begin, key_end).
  template <typename Visit>
  void for_each_run(Visit&& visit) const {
    std::int64_t index = 0;
    for (const KvExtent& extent : view.extents) {
      const std::int64_t begin = std::max(index, key_begin),
                         end = std::min(index + extent.length, key_end);
      if (begin < end) visit(begin - key_begin, extent.start_slot + (begin - index), end - begin);
      index += extent.length;
    }
  }
};

namespace {

// Softmax of each row of `scores` over the keys its query sees, zero elsewhere. Row r is query
// r % queries (rows are heads x queries, head-major).
void masked_softmax(const AttentionGroup& task, RowMatrix& scores) {
  const std::int64_t queries = task.queries();
  for (std::int64_t r = 0; r < scores.rows(); ++r) {
    // query, K/V head (counted from the task's first)
    const std::int64_t i = r % queries, k = (task.head_begin + r / queries) / task.group;
    const std::int64_t first = task.first_visible(i), last = task.last_visible(i);
    auto row = scores.row(r);
    auto visible = row.segment(first, last - first + 1);
    const std::uint8_t* mask = task.column_mask(k);  // keys a per-head KV policy hid
    for (std::int64_t j = first; mask != nullptr && j <= last; ++j)
      if (mask[j] == 0) row[j] = -std::numeric_limits<float>::infinity();
    const float max_score = visible.maxCoeff();  // finite: a query always sees its own key
    visible = (visible.array() - max_score).exp();
    for (std::int64_t j = first; mask != nullptr && j <= last; ++j)
      if (mask[j] == 0) row[j] = 0;  // exactly: a vectorized exp may leave exp(-inf) a denormal
    visible /= visible.sum();
    row.head(first).setZero();
    row.tail(scores.cols() - 1 - last).setZero();
    if (task.key_scores != nullptr && i >= task.scored_from)
      Eigen::Map<Eigen::RowVectorXf>(task.key_scores + k * scores.cols(), scores.cols()) += row;
  }
}

}  // namespace

namespace {

// Fewer prompt-chunk tasks than threads (one sequence's prefill with few K/V heads: Gemma 3's
// one): each is split into parts of its query heads, so that every thread gets one and the
// products run inside the parallel region (BLAS single-threaded there: not OpenBLAS's own team
// beside the backend's threads). Each part reads its K/V head again. Not for scored tasks,
// whose parts would add into one row of key scores at once.
void split_chunk_tasks(std::vector<AttentionGroup>& tasks, int threads) {
  const auto count = static_cast<std::int64_t>(tasks.size());
  if (count == 0 || count >= threads) return;
  std::vector<AttentionGroup> parts;
  for (const AttentionGroup& task : tasks) {
    const std::int64_t split = task.queries() > 1 && task.kv_count == 1
                                   ? std::min(task.group, (threads + count - 1) / count)
                                   : 1;
    for (std::int64_t p = 0; p < split; ++p) {
      parts.push_back(task);
      if (split == 1) continue;
      parts.back().head_begin = p * task.group / split;
      parts.back().head_count = (p + 1) * task.group / split - p * task.group / split;
    }
  }
  tasks = std::move(parts);
}

// A prompt chunk's queries in blocks of kQueryBlock to 2 kQueryBlock - 1 (one block below
// 2 kQueryBlock): each block's products stop at the last key its last query sees and start at the
// oldest its first query's window keeps, so a causal chunk no longer computes the half of its
// (queries, keys) scores the mask then zeroes, and its scores are a block's rows, not the chunk's.
constexpr std::int64_t kQueryBlock = 64;

void push_query_blocks(const AttentionGroup& task, std::vector<AttentionGroup>& tasks) {
  const std::int64_t n = task.queries(), blocks = std::max<std::int64_t>(1, n / kQueryBlock);
  for (std::int64_t b = 0; b < blocks; ++b) {
    AttentionGroup part = task;
    part.query_begin = n * b / blocks;
    part.query_count = n * (b + 1) / blocks - part.query_begin;
    part.row0 = task.row0 + part.query_begin;
    part.key_end = task.view.index_at_or_after(part.first_position() + part.query_count);
    if (task.window)
      part.key_begin = task.view.index_at_or_after(part.first_position() - *task.window + 1);
    tasks.push_back(part);
  }
}

// An entry's tasks (`task` over all its K/V heads): the whole entry for a decode when entries
// are many enough (whole_entries), else one per K/V head, a prompt chunk's in query blocks.
void push_entry_tasks(const AttentionGroup& task, bool whole_entries,
                      std::vector<AttentionGroup>& tasks) {
  const bool decode = task.queries() == 1;
  if (decode && whole_entries) return tasks.push_back(task);
  for (std::int64_t h = 0; h < task.kv_count; ++h) {
    AttentionGroup head = task;
    head.kv_head = h;
    head.kv_count = 1;
    if (decode)
      tasks.push_back(head);
    else
      push_query_blocks(head, tasks);
  }
}

}  // namespace

// Attention of every entry's new tokens over its cached K/V, read in place from the pool. One
// task per (entry, KV head) serves all the query heads of that KV head's group, so each K and V
// row is read once per group; runs of consecutive slots (extents, or paged blocks) are only
// boundaries of the walk, not separate products.
void CpuBackend::attend(std::int64_t layer, std::span<const BatchEntry> batch,
                        std::span<const std::int64_t> first_rows, const RowMatrix& q,
                        RowMatrix& out) {
  const ModelConfig& c = weights_.config;
  const std::int64_t kv_heads = c.num_key_value_heads, group = c.group_size();
  const std::optional<std::int64_t> window = layer_window(layer);
  out.resize(q.rows(), c.q_dim());
  // A decode task takes a whole entry when there are entries enough for every thread: it then
  // reads the entry's slot rows whole, in order. Otherwise (and for prompt chunks) one task per
  // (entry, K/V head), so that few sequences still spread over the threads.
  const bool whole_entries =
      static_cast<std::int64_t>(batch.size()) >= whole_entry_attention_sequences(num_threads());
  const bool matched =
      !groups_.uniform() && group_of(layer) != 0 &&
      (!key_scores_.empty() ||
       std::any_of(batch.begin(), batch.end(), [](auto& e) { return !e.key_mask.empty(); }));
  if (matched) match_group_keys(layer, batch);
  std::vector<AttentionGroup> tasks;
  for (std::size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& entry = batch[e];
    const KvView& view = group_view(entry, group_of(layer));
    const std::int64_t last_position =
        entry.start_position + static_cast<std::int64_t>(entry.tokens.size()) - 1;
    const std::int64_t key_begin =  // the oldest key any query sees
        window ? view.index_at_or_after(entry.start_position - *window + 1) : 0;
    const std::int64_t key_end = view.index_at_or_after(last_position + 1);
    const std::uint8_t* mask = entry.key_mask.empty() ? nullptr
                               : matched              ? group_keys_[e].mask.data()
                                         : entry.key_mask.data() + layer * kv_heads * view.length();
    push_entry_tasks(
        {entry, view, 0, kv_heads, group, first_rows[e], key_begin, key_end, window, mask},
        whole_entries, tasks);
  }
  std::vector<std::size_t> task_entries;  // scored tasks' entries, when some entry asks
  if (!key_scores_.empty())
    task_entries = give_score_buffers(batch, tasks);
  else
    split_chunk_tasks(tasks, num_threads());
  // Guided: the last tasks go to whichever thread is free (entries' lengths differ, and so do
  // the threads' speeds on a shared machine).
  const std::int64_t pool_layer = groups_.pool_layer[static_cast<std::size_t>(layer)];
  parallel_for(static_cast<std::int64_t>(tasks.size()), [&](std::int64_t t) {
    const AttentionGroup& task = tasks[static_cast<std::size_t>(t)];
    if (task.queries() == 1)
      attend_decode(pool_layer, task, q, out);
    else
      attend_chunk(pool_layer, task, q, out);
  });
  add_task_scores(layer, batch, tasks, task_entries, matched);
}

// Each scored task's key sums into its entry's (layers, kv_heads, length) key scores, at the
// entry view's indices (`matched`: the group view's keys mapped by match_group_keys).
void CpuBackend::add_task_scores(std::int64_t layer, std::span<const BatchEntry> batch,
                                 std::span<const AttentionGroup> tasks,
                                 std::span<const std::size_t> task_entries, bool matched) {
  const std::int64_t kv_heads = weights_.config.num_key_value_heads;
  for (std::size_t t = 0; t < task_entries.size(); ++t) {
    const AttentionGroup& task = tasks[t];
    if (task.key_scores == nullptr) continue;
    const std::size_t e = task_entries[t];
    const std::int64_t length = batch[e].view.length();
    const std::int64_t* index = matched ? group_keys_[e].index.data() + task.key_begin : nullptr;
    for (std::int64_t k = 0; k < task.kv_count; ++k) {
      float* entry_scores =
          key_scores_.data() + score_offsets_[e] + ((layer * kv_heads) + task.kv_head + k) * length;
      const float* sums = task.key_scores + k * task.keys();
      for (std::int64_t j = 0; j < task.keys(); ++j)
        entry_scores[index != nullptr ? index[j] : task.key_begin + j] += sums[j];
    }
  }
}

// Each entry's keys in the layer's group view, numbered as in its view (group 0's: the global
// layers hold every position a sliding group does), and the layer's key mask in the group
// view's numbering.
void CpuBackend::match_group_keys(std::int64_t layer, std::span<const BatchEntry> batch) {
  const std::int64_t kv_heads = weights_.config.num_key_value_heads;
  group_keys_.resize(batch.size());
  for (std::size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& entry = batch[e];
    const KvView& view = group_view(entry, group_of(layer));
    GroupKeys& keys = group_keys_[e];
    // (a view's length walks its extents: once each, not once a key)
    const std::int64_t length = view.length(), entry_length = entry.view.length();
    keys.index.resize(static_cast<std::size_t>(length));
    std::int64_t i = 0;
    for (std::int64_t j = 0; j < length; ++j) {
      const std::int64_t position = view.position_at(j);
      while (i < entry_length && entry.view.position_at(i) < position) ++i;
      if (i == entry_length || entry.view.position_at(i) != position)
        throw Error(fmt::format(
            "KV group {} holds position {}, which the entry's view (group 0) does not: group 0 "
            "must hold every position a sliding group holds",
            group_of(layer), position));
      keys.index[static_cast<std::size_t>(j)] = i;
    }
    keys.mask.clear();
    if (entry.key_mask.empty()) continue;
    const std::uint8_t* rows = entry.key_mask.data() + layer * kv_heads * entry_length;
    for (std::int64_t h = 0; h < kv_heads; ++h)
      for (const std::int64_t index : keys.index)
        keys.mask.push_back(rows[h * entry_length + index]);
  }
}

// Points each task of a scoring entry at a zeroed buffer of its own (threads never share one);
// returns each task's entry.
std::vector<std::size_t> CpuBackend::give_score_buffers(std::span<const BatchEntry> batch,
                                                        std::vector<AttentionGroup>& tasks) {
  std::vector<std::size_t> entries(tasks.size());
  std::size_t e = 0, total = 0;
  for (std::size_t t = 0; t < tasks.size(); ++t) {
    while (&batch[e] != &tasks[t].entry) ++e;
    entries[t] = e;
    if (batch[e].scored_queries > 0)
      total += static_cast<std::size_t>(tasks[t].kv_count * tasks[t].keys());
  }
  task_scores_.assign(total, 0.0f);
  total = 0;
  for (std::size_t t = 0; t < tasks.size(); ++t) {
    const BatchEntry& entry = batch[entries[t]];
    if (entry.scored_queries <= 0) continue;
    tasks[t].key_scores = task_scores_.data() + total;
    tasks[t].scored_from = std::max<std::int64_t>(  // counted from the task's first query
        0, static_cast<std::int64_t>(entry.tokens.size()) - entry.scored_queries -
               tasks[t].query_begin);
    total += static_cast<std::size_t>(tasks[t].kv_count * tasks[t].keys());
  }
  return entries;
}

// One query per head. Each run of slots is walked in chunks of 32 keys that stay in cache while
// every query head of the task reads them: K and V come from memory once per step.
void CpuBackend::attend_decode(std::int64_t layer, const AttentionGroup& task, const RowMatrix& q,
                               RowMatrix& out) const {
  constexpr std::int64_t kChunk = 32;
  const KvPoolShape& shape = pool_.shape();
  const DType key_dtype = shape.dtype_of(false), value_dtype = shape.dtype_of(true);
  const std::int64_t hd = weights_.config.head_dim, heads = task.heads();
  const std::int64_t strides[2] = {shape.slot_row_bytes(false),
                                   shape.slot_row_bytes(true)};  // bytes between K, V rows
  auto offset = [&](std::int64_t h, bool value) {  // bytes into a slot row of head h's K/V head
    return (task.kv_head + h / task.group) * shape.head_row_bytes(value);
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const bool kivi = dtype_is_kivi(key_dtype);  // its groups' keys and values: kivi_attention.hpp
  RowMatrix scores(heads, task.keys());        // (heads, keys)
  const float* queries = q.row(task.row0).data() + task.first_head() * hd;  // (heads, hd)
  // A whole-entry task reads whole slot rows: while each head works on one chunk, it asks for
  // its share of the next chunk's consecutive bytes (K's, then V's), so memory streams them in
  // order and ahead of use, spread over the heads' work (a burst of prefetches would wait on the
  // core's miss buffers), instead of head slice by head slice. The row kernels then fetch ahead
  // only within the chunk; for a single head they fetch ahead within the run.
  const bool whole_rows = task.kv_count == shape.kv_heads;
  struct Chunk {
    std::int64_t column, slot, count, readable;  // readable: rows the kernels may fetch ahead
  };
  thread_local std::vector<Chunk> chunks;  // the task's runs in chunks, in order
  chunks.clear();
  task.for_each_run([&](std::int64_t column, std::int64_t slot, std::int64_t length) {
    for (std::int64_t j = 0; j < length; j += kChunk) {
      const std::int64_t count = std::min(kChunk, length - j);
      chunks.push_back({column + j, slot + j, count, whole_rows ? count : length - j});
    }
  });
  auto fetch_share = [&](bool value, std::size_t i, std::int64_t h) {
    if (!whole_rows || i >= chunks.size()) return;
    const std::int64_t bytes = chunks[i].count * strides[value ? 1 : 0];
    const std::int64_t share = (bytes + heads - 1) / heads;
    const std::int64_t begin = std::min(bytes, h * share), end = std::min(bytes, begin + share);
    const std::int64_t slot = chunks[i].slot;
    prefetch_bytes((value ? pool_.value_bytes(layer, slot) : pool_.key_bytes(layer, slot)) + begin,
                   end - begin);
  };
  for (std::int64_t h = 0; h < heads; ++h) fetch_share(false, 0, h);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto [column, slot, count, readable] = chunks[i];
    for (std::int64_t h = 0; h < heads; ++h) {
      fetch_share(i + 1 < chunks.size() ? false : true, i + 1 < chunks.size() ? i + 1 : 0, h);
      if (kivi)
        score_kivi_keys(pool_, layer, task.kv_head + h / task.group, queries + h * hd, slot, count,
                        scale, &scores(h, column));
      else
        score_rows(key_dtype, queries + h * hd, pool_.key_bytes(layer, slot) + offset(h, false),
                   strides[0], count, readable, hd, scale, &scores(h, column));
    }
  }
  masked_softmax(task, scores);
  float* o = out.row(task.row0).data() + task.first_head() * hd;  // (heads, hd)
  std::fill(o, o + heads * hd, 0.0f);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto [column, slot, count, readable] = chunks[i];
    for (std::int64_t h = 0; h < heads; ++h) {
      fetch_share(true, i + 1, h);
      if (kivi)
        add_kivi_values(pool_, layer, task.kv_head + h / task.group, &scores(h, column), slot,
                        count, o + h * hd);
      else
        add_weighted_rows(value_dtype, &scores(h, column),
                          pool_.value_bytes(layer, slot) + offset(h, true), strides[1], count,
                          readable, hd, o + h * hd);
    }
  }
}

// Head `kv_head` of `length` consecutive slots as (length, hd) fp32: the pool rows in place
// (f32), or widened into a buffer of this thread's (every other dtype).
CpuBackend::StridedMap CpuBackend::head_rows(std::int64_t layer, std::int64_t slot,
                                             std::int64_t length, std::int64_t kv_head,
                                             bool value) const {
  const KvPoolShape& shape = pool_.shape();
  const std::int64_t hd = shape.head_dim;
  if (shape.dtype_of(value) == DType::dtype_f32) {
    const float* first = (value ? pool_.value(layer, slot) : pool_.key(layer, slot)) + kv_head * hd;
    return {first, length, hd, Eigen::OuterStride<>(shape.slot_width())};
  }
  thread_local std::vector<float> widened[2];  // K and V of the run being used
  auto& buffer = widened[value ? 1 : 0];
  buffer.resize(static_cast<std::size_t>(length * hd));
  pool_.read_head_rows(layer, slot, length, value, kv_head, buffer.data());
  return {buffer.data(), length, hd, Eigen::OuterStride<>(hd)};
}

// Several queries (a prefill chunk): the group's queries stacked (heads x queries, hd) meet each
// run of K and V in one product.
void CpuBackend::attend_chunk(std::int64_t layer, const AttentionGroup& task, const RowMatrix& q,
                              RowMatrix& out) const {
  const std::int64_t hd = weights_.config.head_dim, n = task.queries();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const std::int64_t heads = task.heads();  // one K/V head's group (task.kv_count == 1)
  RowMatrix stacked(heads * n, hd);         // row h*n + i: head first_head + h, query i
  for (std::int64_t h = 0; h < heads; ++h)
    stacked.middleRows(h * n, n) = q.block(task.row0, (task.first_head() + h) * hd, n, hd);
  RowMatrix scores(heads * n, task.keys());
  task.for_each_run([&](std::int64_t column, std::int64_t slot, std::int64_t length) {
    const StridedMap k = head_rows(layer, slot, length, task.kv_head, false);  // (length, hd)
    // The product straight into its columns, then scaled there: `(stacked * k^T) * scale` went
    // through a column-major temporary copied back with strided loads (a tenth of a prefill).
    auto columns = scores.middleCols(column, length);
    columns.noalias() = stacked * k.transpose();
    columns *= scale;
  });
  masked_softmax(task, scores);
  RowMatrix result = RowMatrix::Zero(heads * n, hd);
  task.for_each_run([&](std::int64_t column, std::int64_t slot, std::int64_t length) {
    const StridedMap v = head_rows(layer, slot, length, task.kv_head, true);  // (length, hd)
    result.noalias() += scores.middleCols(column, length) * v;
  });
  for (std::int64_t h = 0; h < heads; ++h)
    out.block(task.row0, (task.first_head() + h) * hd, n, hd) = result.middleRows(h * n, n);
}

// Latent attention (MLA), the absorbed form: W_uk goes into the query and W_uv after the
// output, so every head reads the cached latent itself. With c the latent and k_r the RoPE key,
// q_h . k_h = (W_uk,h^T q_nope,h) . c + q_rope,h . k_r and sum_j p_j v_j = W_uv,h sum_j p_j c_j:
// the cache is read as one K/V head of latent_dim values (keys: the whole latent; values: its
// first kv_lora_rank). qkv (N, q_dim + latent_dim): each token's Q | latent | RoPE key, in place.
// out: (N, heads x v_head_dim).
void CpuBackend::latent_attend(std::int64_t layer, std::span<const BatchEntry> batch,
                               std::span<const std::int64_t> first_rows,
                               std::span<const std::int32_t> positions,
                               std::span<const std::int64_t> slots, RowMatrix& qkv,
                               RowMatrix& out) {
  const ModelConfig& c = weights_.config;
  const std::int64_t heads = c.num_attention_heads, hd = c.head_dim, nope = c.qk_nope_head_dim,
                     rank = c.kv_lora_rank, latent = c.latent_dim(), vd = c.v_head_dim;
  const LayerWeightsView& weights = weights_.layers[static_cast<std::size_t>(layer)];
  const RopeTable& rope = ropes_.for_layer(layer);
  const std::int64_t pool_layer = groups_.pool_layer[static_cast<std::size_t>(layer)];
  const auto eps = static_cast<float>(c.rms_norm_eps);
  parallel_for(
      qkv.rows(),
      [&](std::int64_t t) {  // the latent normed, Q's and the key's RoPE parts rotated, stored
        float* row = qkv.row(t).data();
        const std::int32_t position = positions[static_cast<std::size_t>(t)];
        for (std::int64_t h = 0; h < heads; ++h) rope.apply_row(row + h * hd + nope, position, 1);
        float* cached = row + c.q_dim();  // (latent): c | k_r
        rms_norm_row_heads(cached, 1, as_vector(weights.kv_a_norm), eps);
        rope.apply_row(cached + rank, position, 1);
        const std::int64_t slot = slots[static_cast<std::size_t>(t)];
        if (slot < 0) return;
        pool_.write_row(pool_layer, slot, false, cached);              // first half
        pool_.write_row(pool_layer, slot, true, cached + latent / 2);  // second half
      },
      17);
  const Eigen::Map<const RowMatrix> kv_b = as_matrix(weights.w_kv_b);  // (heads (nope | v), rank)
  RowMatrix& absorbed = q_absorbed_;  // (N, heads x latent): W_uk,h^T q_nope,h | q_rope,h
  absorbed.resize(qkv.rows(), heads * latent);
  for (std::int64_t h = 0; h < heads; ++h) {
    absorbed.middleCols(h * latent, rank).noalias() =
        qkv.middleCols(h * hd, nope) * kv_b.middleRows(h * (nope + vd), nope);
    absorbed.middleCols(h * latent + rank, latent - rank) =
        qkv.middleCols(h * hd + nope, latent - rank);
  }
  latent_out_.resize(qkv.rows(), heads * rank);  // (N, heads x rank): sum_j p_j c_j
  parallel_for(static_cast<std::int64_t>(batch.size()), [&](std::int64_t e) {
    latent_attend_entry(pool_layer, batch[static_cast<std::size_t>(e)],
                        first_rows[static_cast<std::size_t>(e)]);
  });
  out.resize(qkv.rows(), heads * vd);
  for (std::int64_t h = 0; h < heads; ++h)
    out.middleCols(h * vd, vd).noalias() = latent_out_.middleCols(h * rank, rank) *
                                           kv_b.middleRows(h * (nope + vd) + nope, vd).transpose();
}

// One entry's queries (every head) over its cached latents, read whole rows at a time: scores
// (heads x queries, keys), softmax, then the weighted latents into latent_out_.
void CpuBackend::latent_attend_entry(std::int64_t pool_layer, const BatchEntry& entry,
                                     std::int64_t row0) {
  const ModelConfig& c = weights_.config;
  const std::int64_t heads = c.num_attention_heads, rank = c.kv_lora_rank, latent = c.latent_dim(),
                     half = latent / 2;
  const std::int64_t n = static_cast<std::int64_t>(entry.tokens.size());
  const KvView& view = entry.view;
  const std::int64_t key_begin =
      window_ ? view.index_at_or_after(entry.start_position - *window_ + 1) : 0;
  const std::int64_t key_end = view.index_at_or_after(entry.start_position + n);
  const AttentionGroup task{entry, view, 0, 1, heads, row0, key_begin, key_end, window_};
  RowMatrix cached(task.keys(), latent);  // (keys, latent): the pool's two halves side by side
  task.for_each_run([&](std::int64_t column, std::int64_t slot, std::int64_t length) {
    for (std::int64_t j = 0; j < length; ++j) {
      pool_.read_row(pool_layer, slot + j, false, cached.row(column + j).data());
      pool_.read_row(pool_layer, slot + j, true, cached.row(column + j).data() + half);
    }
  });
  RowMatrix stacked(heads * n, latent);  // row h n + i: head h, query i
  for (std::int64_t h = 0; h < heads; ++h)
    stacked.middleRows(h * n, n) = q_absorbed_.block(row0, h * latent, n, latent);
  RowMatrix scores = (stacked * cached.transpose()) *  // (heads x n, keys)
                     (1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  masked_softmax(task, scores);
  const RowMatrix weighted = scores * cached.leftCols(rank);  // (heads x n, rank)
  for (std::int64_t h = 0; h < heads; ++h)
    latent_out_.block(row0, h * rank, n, rank) = weighted.middleRows(h * n, n);
}

}  // namespace kvlab::cpu
