#pragma once
// The cost model's view of a step, shared by CostModel::work (the groups it prices) and
// CostModel::breakdown (the operators inside them), so the two cannot drift apart.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>

#include "kvlab/model_config.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab::sim_detail {

// One GPU's share of a layer's shapes under tensor parallelism.
struct ShardShapes {
  double hidden, inter, q, kv, vocab;  // inter, q, vocab split; kv: this GPU's K/V heads
  double layer_weights;                // W_qkv + W_o + W_gate_up + W_down
};

inline ShardShapes shard_shapes(const ModelConfig& m, std::int64_t tp,
                                std::int64_t kv_heads_per_gpu) {
  const double t = static_cast<double>(tp);
  ShardShapes s;
  s.hidden = static_cast<double>(m.hidden_size);
  s.inter = static_cast<double>(m.intermediate_size) / t;
  s.q = static_cast<double>(m.q_dim()) / t;
  s.kv = static_cast<double>(kv_heads_per_gpu * m.head_dim);
  s.vocab = static_cast<double>(m.vocab_size) / t;
  // W_qkv (hidden, q + 2kv), W_o (q, hidden), W_gate_up (hidden, 2 inter), W_down (inter, hidden).
  s.layer_weights = s.hidden * (s.q + 2 * s.kv) + s.q * s.hidden + 3 * s.hidden * s.inter;
  return s;
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
