#pragma once
// The cost model's view of a step, shared by CostModel::work (the groups it prices) and
// CostModel::breakdown (the operators inside them), so the two cannot drift apart.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>

#include <boost/container/static_vector.hpp>

#include "kvlab/model_config.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab::sim_detail {

// One GPU's share of a layer's shapes under tensor parallelism.
struct ShardShapes {
  double hidden, inter, q, kv, vocab;  // inter, q, vocab split; kv: this GPU's K/V heads' values
  double attention_out;                // o_proj's input: the value heads' (split)
  // QK^T and PV FLOPs a (query, key) pair over this GPU's heads: a prefill's, and a decode's
  // (MLA: a decode reads the latent with W_uk and W_uv absorbed into the query and the output,
  // so every head works over the whole latent, as vLLM's and FlashMLA's decode do).
  double prefill_pair_flops, decode_pair_flops;
};

inline ShardShapes shard_shapes(const ModelConfig& m, std::int64_t tp,
                                std::int64_t kv_heads_per_gpu) {
  const double t = static_cast<double>(tp);
  ShardShapes s;
  s.hidden = static_cast<double>(m.hidden_size);
  s.inter = static_cast<double>(m.intermediate_size) / t;
  s.q = static_cast<double>(m.q_dim()) / t;
  s.kv = static_cast<double>(kv_heads_per_gpu * m.cache_head_dim());  // MLA: half the latent
  s.vocab = static_cast<double>(m.vocab_size) / t;
  s.attention_out = static_cast<double>(m.attention_output_dim()) / t;
  s.prefill_pair_flops = 2 * (s.q + s.attention_out);
  const double heads = static_cast<double>(m.num_attention_heads) / t;
  s.decode_pair_flops = m.is_mla()
                            ? 2 * heads * static_cast<double>(m.latent_dim() + m.kv_lora_rank)
                            : s.prefill_pair_flops;
  if (m.has_experts()) {  // the MLP width a token uses, averaged over the layers
    const ModelConfig::Experts& e = m.experts;
    const auto layers = static_cast<double>(m.num_hidden_layers);
    const double dense = static_cast<double>(e.first_dense_layers * m.intermediate_size);
    const double experts = static_cast<double>((m.num_hidden_layers - e.first_dense_layers) *
                                               (e.per_token + e.shared) * e.intermediate_size);
    s.inter = (dense + experts) / layers / t;
  }
  return s;
}

// One GEMM of every layer, one GPU's share: `rows` activations of `in` values times an (in, out)
// weight (averaged over the layers where they differ: a mixture of experts' dense first layers),
// of which weight_reads x in x out are read from memory in the step.
struct LayerGemm {
  const char* name;
  double in, out, rows, weight_reads;
};

// The expected share of a layer's routed experts that `tokens` tokens route to, each to k of E
// uniformly: 1 - (1 - k/E)^tokens (a decode of few tokens reads few experts' weights).
inline double routed_share_read(const ModelConfig::Experts& e, double tokens) {
  const double k = static_cast<double>(e.per_token), n = static_cast<double>(e.routed);
  return 1 - std::pow(1 - k / n, tokens);
}

// A step's GEMMs in every layer for `tokens` tokens. MLA's: q_proj (or q_a, q_b), kv_a_proj,
// kv_b_proj (over the new tokens, and over the `rebuilt` prefill keys already cached: a prefill
// rebuilds its context's K and V from their latents) and o_proj. A mixture of experts' MLP does
// the FLOPs of the experts a token uses and reads the weights of the experts the step routes to.
// At most 7 of them: MLA's q_a, q_b, kv_a, kv_b and o, a router, the MLP's two.
using LayerGemms = boost::container::static_vector<LayerGemm, 8>;

inline LayerGemms layer_gemms(const ModelConfig& m, const ShardShapes& g, std::int64_t tp,
                              double tokens, double rebuilt) {
  const double t = static_cast<double>(tp);
  LayerGemms gemms;
  if (m.is_mla()) {
    const auto q_lora = static_cast<double>(m.q_lora_rank);
    if (q_lora > 0) {  // replicated down-projection, split up-projection
      gemms.push_back({"q_a_proj", g.hidden, q_lora, tokens, 1});
      gemms.push_back({"q_b_proj", q_lora, g.q, tokens, 1});
    } else {
      gemms.push_back({"q_proj", g.hidden, g.q, tokens, 1});
    }
    gemms.push_back({"kv_a_proj", g.hidden, static_cast<double>(m.latent_dim()), tokens, 1});
    const double kv_b_out =
        static_cast<double>(m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)) / t;
    gemms.push_back(
        {"kv_b_proj", static_cast<double>(m.kv_lora_rank), kv_b_out, tokens + rebuilt, 1});
    gemms.push_back({"o_proj", g.attention_out, g.hidden, tokens, 1});
  } else {
    gemms.push_back({"qkv_proj", g.hidden, g.q + 2 * g.kv, tokens, 1});
    gemms.push_back({"o_proj", g.q, g.hidden, tokens, 1});
  }
  if (!m.has_experts()) {
    gemms.push_back({"gate_up_proj", g.hidden, 2 * g.inter, tokens, 1});
    gemms.push_back({"down_proj", g.inter, g.hidden, tokens, 1});
    return gemms;
  }
  // The width read over the width used (g.inter), averaged over the layers.
  const ModelConfig::Experts& e = m.experts;
  const double layers = static_cast<double>(m.num_hidden_layers);
  const double moe_layers = layers - static_cast<double>(e.first_dense_layers);
  const double read = (static_cast<double>(e.first_dense_layers * m.intermediate_size) +
                       moe_layers *
                           (static_cast<double>(e.routed) * routed_share_read(e, tokens) +
                            static_cast<double>(e.shared)) *
                           static_cast<double>(e.intermediate_size)) /
                      layers / t;
  const double reads = read / g.inter;
  gemms.push_back(
      {"router", g.hidden, static_cast<double>(e.routed) * moe_layers / layers, tokens, 1});
  gemms.push_back({"gate_up_proj", g.hidden, 2 * g.inter, tokens, reads});
  gemms.push_back({"down_proj", g.inter, g.hidden, tokens, reads});
  return gemms;
}

// A batch's tokens and attention work, before any parallelism.
struct BatchTally {
  std::int64_t tokens = 0, logit_rows = 0;
  double prefill_pairs = 0, prefill_context = 0, prefill_tokens = 0, decode_context = 0;
};

// With `window` W (a local layer's): each query sees at most its last W keys.
inline BatchTally tally_batch(std::span<const EntryShape> batch,
                              std::optional<std::int64_t> window = std::nullopt) {
  BatchTally t;
  const double w = window ? static_cast<double>(*window) : 0x1p62;
  for (const EntryShape& e : batch) {
    t.tokens += e.new_tokens;
    t.logit_rows += e.logit_rows;  // one a sequence, 1 + k for a verify of k proposals
    const double n = static_cast<double>(e.new_tokens);
    const double before = static_cast<double>(e.start_position - e.first_position);
    if (e.new_tokens == 1 && e.start_position > 0) {
      t.decode_context += std::min(before + 1, w);
    } else {  // causal: token i attends to min(`before` + i + 1, W) keys
      const double first = before + 1, uncapped = std::clamp(w - first + 1, 0.0, n);
      t.prefill_pairs += uncapped * first + uncapped * (uncapped - 1) / 2 + (n - uncapped) * w;
      t.prefill_context += std::min(before, w - 1) + n;
      t.prefill_tokens += n;
    }
  }
  return t;
}

// The attention tallies summed over the model's layers: `layers` times `all` (tally_batch's of
// the batch), except
// that a local layer of a local:global model (ModelConfig::layer_window: Gemma 3) sees at most
// its window. A model's own sliding_window is left to the views (the engine releases what falls
// out of it: their first_position).
struct LayerTally {
  double prefill_pairs = 0, prefill_context = 0, decode_context = 0;
};
inline LayerTally layer_tally(std::span<const EntryShape> batch, const ModelConfig& m,
                              const BatchTally& all) {
  std::int64_t local = 0;
  for (std::int64_t l = 0; l < m.num_hidden_layers; ++l) local += m.is_local_layer(l) ? 1 : 0;
  const double global_layers = static_cast<double>(m.num_hidden_layers - local);
  LayerTally t{global_layers * all.prefill_pairs, global_layers * all.prefill_context,
               global_layers * all.decode_context};
  if (local > 0) {
    const BatchTally windowed = tally_batch(batch, m.local_window);
    const double l = static_cast<double>(local);
    t.prefill_pairs += l * windowed.prefill_pairs;
    t.prefill_context += l * windowed.prefill_context;
    t.decode_context += l * windowed.decode_context;
  }
  return t;
}

// (compute, memory) efficiencies of the roofline groups for a step's rows.
struct GroupEfficiencies {
  std::pair<double, double> linear, lm_head, attention_prefill, attention_decode;
};

inline GroupEfficiencies group_efficiencies(const StepWork& w, const HardwareProfile& p) {
  const Efficiency& e = p.efficiency;
  const std::pair<double, double> gemm{e.gemm_compute, e.gemm_memory};
  GroupEfficiencies g;
  g.linear = regime_efficiency(p.gemm_regimes, w.tokens, gemm);       // rows: tokens
  g.lm_head = regime_efficiency(p.gemm_regimes, w.logit_rows, gemm);  // rows: logit rows
  g.attention_prefill = {e.attention_compute, e.attention_memory};
  g.attention_decode = regime_efficiency(p.decode_attention_regimes, w.sequences,
                                         {e.attention_compute, e.attention_memory});
  return g;
}

}  // namespace kvlab::sim_detail
