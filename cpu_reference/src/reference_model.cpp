#include "kvlab/cpu_reference/reference_model.hpp"

#include <fmt/format.h>

#include <cmath>
#include <numeric>

#include "kvlab/error.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

// x += product, or x += RMSNorm(product) when the model has a norm after the block (Gemma's
// post-attention and post-feedforward norms: a non-empty post_norm).
template <typename Product>
void add_output(const Product& product, const Eigen::VectorXf& post_norm, float eps, RowMatrix& out,
                RowMatrix& x) {
  if (post_norm.size() == 0) {
    x.noalias() += product;
    return;
  }
  out.noalias() = product;
  rms_norm(out, post_norm, eps, out);
  x += out;
}

}  // namespace

// Latent attention the plain way (DeepSeek-V2's equations 9-19): every head's K and V rebuilt
// from the RMS-normed latent, the RoPE key shared by the heads. normed: (T, dim);
// attention: (T, heads x v_head_dim).
void ReferenceModel::latent_attention(std::int64_t l, const RowMatrix& normed,
                                      std::span<const std::int32_t> positions,
                                      std::optional<std::int64_t> window,
                                      RowMatrix& attention) const {
  const ModelConfig& c = weights_.config;
  const LayerWeights& layer = weights_.layers[static_cast<std::size_t>(l)];
  const std::int64_t heads = c.num_attention_heads, hd = c.head_dim, nope = c.qk_nope_head_dim,
                     rope = c.qk_rope_head_dim, vd = c.v_head_dim, T = normed.rows();
  const RowMatrix projected = normed * layer.w_qkv.transpose();        // (T, q_dim + latent_dim)
  RowMatrix q = projected.leftCols(c.q_dim());                         // (T, heads x (nope | rope))
  RowMatrix latent = projected.middleCols(c.q_dim(), c.kv_lora_rank);  // (T, kv_lora_rank)
  RowMatrix k_rope = projected.rightCols(rope);                        // (T, rope)
  rms_norm(latent, layer.kv_a_norm, static_cast<float>(c.rms_norm_eps), latent);
  const RowMatrix kv = latent * layer.w_kv_b.transpose();  // (T, heads x (nope | v))
  const RopeTable& table = rope_for_layer(l);
  table.apply(k_rope, positions, 1);
  RowMatrix k(T, heads * hd), v(T, heads * vd);
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t t = 0; t < T; ++t)
      table.apply_row(q.row(t).data() + h * hd + nope, positions[static_cast<std::size_t>(t)], 1);
    k.middleCols(h * hd, nope) = kv.middleCols(h * (nope + vd), nope);
    k.middleCols(h * hd + nope, rope) = k_rope;
    v.middleCols(h * vd, vd) = kv.middleCols(h * (nope + vd) + nope, vd);
  }
  causal_attention(q, k, v, heads, heads, window, attention);
}

// x += MLP(RMSNorm(x)) (and its post norm). normed, out: (T, dim) scratch.
void ReferenceModel::add_mlp(const LayerWeights& layer, RowMatrix& x, RowMatrix& normed,
                             RowMatrix& out) const {
  const ModelConfig& c = weights_.config;
  const auto eps = static_cast<float>(c.rms_norm_eps);
  rms_norm(x, layer.mlp_norm, eps, normed);
  const RowMatrix gate_up = normed * layer.w_gate_up.transpose();  // (T, 2 ffn)
  RowMatrix hidden;                                                // (T, ffn)
  gated_activation(gate_up, c.intermediate_size, c.activation, hidden);
  add_output(hidden * layer.w_down.transpose(), layer.mlp_post_norm, eps, out, x);
}

ReferenceModel::ReferenceModel(LlamaWeights weights)
    : weights_(std::move(weights)), ropes_(weights_.config) {}

RowMatrix ReferenceModel::forward(std::span<const std::int32_t> tokens,
                                  const ForwardOptions& options) const {
  const ModelConfig& c = weights_.config;
  const auto T = static_cast<std::int64_t>(tokens.size());
  if (T == 0) throw Error("forward: empty token sequence");
  if (T > c.max_position_embeddings)
    throw Error(fmt::format("forward: {} tokens exceed the context of {} ({} positions)", T, c.name,
                            c.max_position_embeddings));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      throw Error(
          fmt::format("forward: token id {} at position {} is outside the vocabulary [0, {})",
                      tokens[i], i, c.vocab_size));
  const auto eps = static_cast<float>(c.rms_norm_eps);
  std::vector<std::int32_t> positions(tokens.size());
  std::iota(positions.begin(), positions.end(), 0);

  RowMatrix x(T, c.hidden_size);  // (T, dim) residual stream
  for (std::int64_t t = 0; t < T; ++t)
    x.row(t) = weights_.embedding.row(tokens[static_cast<std::size_t>(t)]);
  if (c.embedding_scale != 1) x *= static_cast<float>(c.embedding_scale);  // Gemma: sqrt(dim)

  RowMatrix normed;     // (T, dim)
  RowMatrix qkv;        // (T, n_heads*hd + 2 n_kv*hd)
  RowMatrix q, k, v;    // (T, n_heads*hd), (T, n_kv*hd), (T, n_kv*hd)
  RowMatrix attention;  // (T, n_heads*hd)
  RowMatrix out;        // (T, dim): the attention's or the MLP's output
  // causal_attention scales scores by 1/sqrt(head_dim); another query scale goes into q.
  const float rescale = query_rescale(c);
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& layer = weights_.layers[static_cast<std::size_t>(l)];
    rms_norm(x, layer.attention_norm, eps, normed);
    const auto window = options.sliding_window ? options.sliding_window : c.layer_window(l);
    if (c.is_mla()) {
      latent_attention(l, normed, positions, window, attention);
      add_output(attention * layer.wo.transpose(), layer.attention_post_norm, eps, out, x);
      add_mlp(layer, x, normed, out);
      continue;
    }
    qkv.noalias() = normed * layer.w_qkv.transpose();
    q = qkv.leftCols(c.q_dim());
    k = qkv.middleCols(c.q_dim(), c.kv_dim());
    v = qkv.rightCols(c.kv_dim());
    if (c.qk_norm) {
      rms_norm_heads(q, layer.q_norm, eps);
      rms_norm_heads(k, layer.k_norm, eps);
    }
    rope_for_layer(l).apply(q, positions, c.num_attention_heads);
    rope_for_layer(l).apply(k, positions, c.num_key_value_heads);
    if (rescale != 1.0f) q *= rescale;
    causal_attention(q, k, v, c.num_attention_heads, c.num_key_value_heads, window, attention);
    add_output(attention * layer.wo.transpose(), layer.attention_post_norm, eps, out, x);
    add_mlp(layer, x, normed, out);
  }
  RowMatrix last_rows;  // (T, 1 or P, dim)
  if (!options.logit_positions.empty()) {
    last_rows.resize(static_cast<std::int64_t>(options.logit_positions.size()), c.hidden_size);
    for (std::size_t i = 0; i < options.logit_positions.size(); ++i) {
      const std::int64_t p = options.logit_positions[i];
      if (p < 0 || p >= T)
        throw Error(fmt::format("forward: logit position {} is outside [0, {})", p, T));
      last_rows.row(static_cast<std::int64_t>(i)) = x.row(p);
    }
  } else {
    const std::int64_t first = options.last_position_only ? T - 1 : 0;
    last_rows = x.bottomRows(T - first);
  }
  rms_norm(last_rows, weights_.final_norm, eps, normed);
  RowMatrix logits = normed * weights_.output_projection().transpose();  // (T or 1, vocab)
  return logits;
}

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::eos:
      return "eos";
    case FinishReason::max_tokens:
      return "max_tokens";
    case FinishReason::context_full:
      return "context_full";
  }
  return "?";
}

GenerationResult generate(const ReferenceModel& model, std::span<const std::int32_t> prompt,
                          const SamplingParams& sampling, std::int32_t top_logprobs_k,
                          const std::function<void(const GeneratedToken&)>& on_token) {
  Sampler sampler(sampling);
  const ModelConfig& c = model.config();
  std::vector<std::int32_t> sequence(prompt.begin(), prompt.end());
  GenerationResult result;
  ForwardOptions options;
  options.last_position_only = true;
  while (true) {
    if (static_cast<std::int64_t>(sequence.size()) >= c.max_position_embeddings) {
      result.finish_reason = FinishReason::context_full;
      break;
    }
    const RowMatrix logits = model.forward(sequence, options);  // (1, vocab)
    const std::span<const float> row(logits.data(), static_cast<std::size_t>(logits.cols()));
    if (auto bad = first_non_finite(row))
      throw Error(fmt::format(
          "generate: the logits at position {} hold {} at token id {}; the model's weights "
          "produce non-finite values, so no token can be sampled",
          sequence.size() - 1, row[*bad], *bad));
    GeneratedToken generated;
    generated.token = sampler.sample(row);
    generated.logprob = token_logprob(row, generated.token);
    if (top_logprobs_k > 0) generated.top = top_logprobs(row, top_logprobs_k);
    result.tokens.push_back(std::move(generated));
    if (on_token) on_token(result.tokens.back());
    sequence.push_back(result.tokens.back().token);
    if (!sampling.ignore_eos && c.is_eos(result.tokens.back().token)) {
      result.finish_reason = FinishReason::eos;
      break;
    }
    if (static_cast<std::int32_t>(result.tokens.size()) >= sampling.max_tokens) {
      result.finish_reason = FinishReason::max_tokens;
      break;
    }
  }
  return result;
}

}  // namespace kvlab::cpu
