#include "kvlab/cpu_reference/cpu_backend.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <fmt/format.h>

#include <Eigen/Dense>
#include <cstring>

#include "kvlab/error.hpp"

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

CpuBackend::CpuBackend(const LlamaWeights& weights, KvPool& pool,
                       std::optional<std::int64_t> window, ComputeWeights compute)
    : weights_(weights),
      compute_(std::move(compute)),
      pool_(pool),
      window_(window),
      rope_(weights.config) {
  const ModelConfig& c = weights.config;
  if (compute_.layers.size() != weights.layers.size() ||
      compute_.output_projection.rows() != c.vocab_size)
    throw Error(fmt::format("internal: compute weights ({} layers) are not {}'s",
                            compute_.layers.size(), c.name));
  if (pool.shape().kv_heads != c.num_key_value_heads || pool.shape().head_dim != c.head_dim ||
      pool.shape().layers != c.num_hidden_layers)
    throw Error(fmt::format(
        "KV pool shape ({} layers, {} KV heads, head_dim {}) does not match the model ({}, {}, {})",
        pool.shape().layers, pool.shape().kv_heads, pool.shape().head_dim, c.num_hidden_layers,
        c.num_key_value_heads, c.head_dim));
}

const RowMatrix& CpuBackend::run(std::span<const BatchEntry> batch) {
  const ModelConfig& c = weights_.config;
  std::vector<std::int64_t> first_rows;  // batch row of each entry's first token
  std::vector<std::int32_t> positions;
  std::int64_t rows = 0;
  for (const auto& e : batch) {
    first_rows.push_back(rows);
    for (std::size_t j = 0; j < e.tokens.size(); ++j) {
      const std::int64_t position = e.start_position + static_cast<std::int64_t>(j);
      if (position >= c.max_position_embeddings)
        throw Error(fmt::format("position {} is beyond the context of {}", position, c.name));
      positions.push_back(static_cast<std::int32_t>(position));
    }
    rows += static_cast<std::int64_t>(e.tokens.size());
  }
  first_rows.push_back(rows);
  const auto eps = static_cast<float>(c.rms_norm_eps);
  const std::int64_t q_dim = c.q_dim(), kv_dim = c.kv_dim();

  RowMatrix& x = x_;  // (N, dim) residual stream of every batch token
  x.resize(rows, c.hidden_size);
  for (std::size_t e = 0; e < batch.size(); ++e)
    for (std::size_t j = 0; j < batch[e].tokens.size(); ++j)
      x.row(first_rows[e] + static_cast<std::int64_t>(j)) =
          weights_.embedding.row(batch[e].tokens[j]);

  RowMatrix &normed = normed_, &qkv = qkv_, &q = q_, &k = k_, &attention = attention_,
            &gate_up = gate_up_, &hidden = hidden_;
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& layer = weights_.layers[static_cast<std::size_t>(l)];
    const LayerComputeWeights& matrices = compute_.layers[static_cast<std::size_t>(l)];
    rms_norm(x, layer.attention_norm, eps, normed);
    multiply_by_transposed(normed, matrices.w_qkv, qkv, false);  // (N, q_dim + 2 kv_dim)
    q = qkv.leftCols(q_dim);                                  // (N, q_dim)
    k = qkv.middleCols(q_dim, kv_dim);                        // (N, kv_dim)
    rope_.apply(q, positions, c.num_attention_heads);
    rope_.apply(k, positions, c.num_key_value_heads);
    // Write the new tokens' K and V into their slots.
    for (std::size_t e = 0; e < batch.size(); ++e)
      for (std::size_t j = 0; j < batch[e].tokens.size(); ++j) {
        const std::int64_t row = first_rows[e] + static_cast<std::int64_t>(j);
        const std::int64_t slot =
            batch[e].view.slot_of(batch[e].start_position + static_cast<std::int64_t>(j));
        std::memcpy(pool_.key(l, slot), k.row(row).data(),
                    static_cast<std::size_t>(kv_dim) * sizeof(float));
        std::memcpy(pool_.value(l, slot), qkv.row(row).data() + q_dim + kv_dim,
                    static_cast<std::size_t>(kv_dim) * sizeof(float));
      }
    attend(l, batch, first_rows, q, attention);
    multiply_by_transposed(attention, matrices.wo, x, true);

    rms_norm(x, layer.mlp_norm, eps, normed);
    multiply_by_transposed(normed, matrices.w_gate_up, gate_up, false);  // (N, 2 ffn)
    hidden.resize(rows, c.intermediate_size);
#pragma omp parallel for if (rows > 16)
    for (std::int64_t t = 0; t < rows; ++t) {  // silu(gate) * up
      const auto gate = gate_up.row(t).head(c.intermediate_size).array();
      hidden.row(t).array() =
          gate / (1.0f + (-gate).exp()) * gate_up.row(t).tail(c.intermediate_size).array();
    }
    multiply_by_transposed(hidden, matrices.w_down, x, true);
  }
  RowMatrix& last = last_;  // (entries, dim)
  last.resize(static_cast<std::int64_t>(batch.size()), c.hidden_size);
  for (std::size_t e = 0; e < batch.size(); ++e)
    last.row(static_cast<std::int64_t>(e)) = x.row(first_rows[e + 1] - 1);
  rms_norm(last, weights_.final_norm, eps, normed);
  multiply_by_transposed(normed, compute_.output_projection, logits_, false);  // (entries, vocab)
  return logits_;
}

// Attention of every entry's new tokens over its cached keys, read in place from the pool:
// each extent of the view is an (length, kv_heads * head_dim) row-major block with the pool's
// row stride, so a head's keys are an Eigen map with an outer stride — no gather.
void CpuBackend::attend(std::int64_t layer, std::span<const BatchEntry> batch,
                        std::span<const std::int64_t> first_rows, const RowMatrix& q,
                        RowMatrix& out) const {
  const ModelConfig& c = weights_.config;
  const std::int64_t hd = c.head_dim, heads = c.num_attention_heads, group = c.group_size();
  const std::int64_t width = pool_.shape().slot_width();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  using StridedMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
  out.resize(q.rows(), q.cols());
  const auto tasks = static_cast<std::int64_t>(batch.size()) * heads;
#pragma omp parallel for schedule(dynamic)
  for (std::int64_t task = 0; task < tasks; ++task) {
    const BatchEntry& e = batch[static_cast<std::size_t>(task / heads)];
    const std::int64_t h = task % heads, kv_head = h / group;
    const std::int64_t row0 = first_rows[static_cast<std::size_t>(task / heads)];
    const auto n_queries = static_cast<std::int64_t>(e.tokens.size());
    const std::int64_t last_position = e.start_position + n_queries - 1;
    std::int64_t key_begin = e.view.first_position;  // oldest key any of these queries sees
    if (window_) key_begin = std::max(key_begin, e.start_position - *window_ + 1);
    const std::int64_t keys = last_position - key_begin + 1;
    // scores (n_queries, keys): column j is position key_begin + j.
    RowMatrix scores(n_queries, keys);
    const auto q_rows = q.block(row0, h * hd, n_queries, hd);  // (n_queries, hd)
    std::int64_t position = e.view.first_position;
    std::vector<std::pair<std::int64_t, KvExtent>>
        pieces;  // (first column, slots) of each extent in range
    for (const KvExtent& extent : e.view.extents) {
      const std::int64_t begin = std::max(position, key_begin),
                         end = std::min(position + extent.length, last_position + 1);
      if (begin < end) {
        const KvExtent piece{extent.start_slot + (begin - position), end - begin};
        pieces.emplace_back(begin - key_begin, piece);
        const StridedMap k(pool_.key(layer, piece.start_slot) + kv_head * hd, piece.length, hd,
                           Eigen::OuterStride<>(width));
        scores.middleCols(begin - key_begin, piece.length).noalias() =
            (q_rows * k.transpose()) * scale;
      }
      position += extent.length;
    }
    for (std::int64_t i = 0; i < n_queries; ++i) {
      const std::int64_t query_position = e.start_position + i;
      const std::int64_t first =
          window_ ? std::max(key_begin, query_position - *window_ + 1) : key_begin;
      auto row = scores.row(i);
      auto visible = row.segment(first - key_begin, query_position - first + 1);
      const float max_score = visible.maxCoeff();
      visible = (visible.array() - max_score).exp();
      visible /= visible.sum();
      row.head(first - key_begin).setZero();
      row.tail(last_position - query_position).setZero();
    }
    auto o = out.block(row0, h * hd, n_queries, hd);
    o.setZero();
    for (const auto& [column, piece] : pieces) {
      const StridedMap v(pool_.value(layer, piece.start_slot) + kv_head * hd, piece.length, hd,
                         Eigen::OuterStride<>(width));
      if (n_queries == 1) {  // decode: o += p_j v_j, one row at a time
        for (std::int64_t j = 0; j < piece.length; ++j)
          o.row(0) += scores(0, column + j) * v.row(j);
      } else {
        o.noalias() += scores.middleCols(column, piece.length) * v;
      }
    }
  }
}

}  // namespace kvlab::cpu
