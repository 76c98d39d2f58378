// CostModel::breakdown: a step's cost operator by operator (kvlab cost). The operators are the
// terms CostModel::work sums into its groups (the same shapes and tallies, step_shapes.hpp);
// the breakdown test checks that they add up to the groups.
#include <algorithm>

#include "kvlab/model/kv_memory.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "step_shapes.hpp"

namespace kvlab {
namespace {

using sim_detail::ShardShapes;

// What one GPU does in a step, the quantities CostModel::work derives from the batch.
struct StepSizes {
  double tokens = 0;  // this GPU's (context parallelism: 1/c of the prefill tokens)
  double decode_tokens = 0;
  double logit_rows = 0;
};

const char* bound_of(const FlopsAndBytes& w, double peak, double bandwidth,
                     std::pair<double, double> e) {
  return w.flops / (peak * e.first) >= w.bytes / (bandwidth * e.second) ? "compute" : "memory";
}

// The operators from `first` on (one kernel a run) share `group_s` (the group's time, per step):
// each run pays the kernel floor, and what is left is shared by their own rooflines (joined at the
// knee) on the group's efficiencies `e`.
void share_group(std::vector<OperatorCost>& ops, std::size_t first, double group_s,
                 const HardwareProfile& p, std::pair<double, double> e, const KernelTerms& kernel) {
  const double peak = p.peak_tflops * 1e12, bandwidth = p.memory_gb_per_s * 1e9;
  double own_total = 0, runs = 0;
  for (std::size_t i = first; i < ops.size(); ++i) {
    OperatorCost& op = ops[i];
    op.seconds = kernel_seconds(op.work, peak, bandwidth, e, kernel.knee);
    op.bound = bound_of(op.work, peak, bandwidth, e);
    own_total += op.seconds * static_cast<double>(op.runs);
    runs += static_cast<double>(op.runs);
  }
  const double shared = group_s - runs * kernel.floor_s;
  for (std::size_t i = first; i < ops.size(); ++i)
    ops[i].seconds = kernel.floor_s + (own_total > 0 ? shared * ops[i].seconds / own_total : 0.0);
}

// A layer's GEMMs (step_shapes.hpp's layer_gemms), their inputs and outputs one GPU's share:
// (2 x rows x in x out) FLOPs, the weights read, the activations in and out.
void add_gemms(std::vector<OperatorCost>& ops, const sim_detail::LayerGemms& gemms,
               std::int64_t layers, double weight, double act) {
  for (const auto& m : gemms)
    ops.push_back({m.name,
                   "linear",
                   layers,
                   {2 * m.rows * m.in * m.out,
                    m.in * m.out * m.weight_reads * weight + m.rows * (m.in + m.out) * act},
                   0,
                   "",
                   true});
}

// Bytes-only operators (elementwise), one kernel a run: priced at their kind's efficiency and
// floor ([elementwise]), else at [efficiency]'s elementwise_memory.
void add_elementwise(std::vector<OperatorCost>& ops, const ShardShapes& g, const StepSizes& s,
                     std::int64_t layers, double weight, double act, double kv_token_bytes,
                     const HardwareProfile& p) {
  using Kind = ElementwiseKind;
  const double per_token = s.tokens;
  const struct {
    const char* name;
    Kind kind;
    std::int64_t runs_a_layer;  // 0: once a step
    double bytes;               // a run's
  } parts[] = {
      {"rms_norm", Kind::rms_norm, 2, per_token * 2 * g.hidden * act},          // read + write
      {"residual_add", Kind::residual_add, 2, per_token * 3 * g.hidden * act},  // 2 in, 1 out
      {"rope", Kind::rope, 1, per_token * (2 * g.q + 2 * g.kv) * act},     // q and k in and out
      {"activation", Kind::activation, 1, per_token * 3 * g.inter * act},  // SwiGLU: 2 in, 1 out
      {"kv_write", Kind::kv_write, 1, per_token * kv_token_bytes},
      {"embedding", Kind::embedding, 0, per_token * g.hidden * (weight + act)},
      {"final_norm", Kind::rms_norm, 0, s.logit_rows * 2 * g.hidden * act},
  };
  const bool terms = has_elementwise_terms(p);
  for (const auto& part : parts) {
    const ElementwiseTerm& t = p.elementwise[static_cast<std::size_t>(part.kind)];
    const double memory = terms && t.memory > 0 ? t.memory : p.efficiency.elementwise_memory;
    const double floor_s = terms ? t.floor_s : 0.0;
    const bool per_layer = part.runs_a_layer > 0;
    ops.push_back({part.name,
                   "elementwise",
                   per_layer ? part.runs_a_layer * layers : 1,
                   {0, part.bytes},
                   floor_s + (terms ? wave_bytes(part.bytes, s.tokens, p) : part.bytes) /
                                 (p.memory_gb_per_s * 1e9 * memory),
                   "memory",
                   per_layer});
  }
}

// Tensor parallelism's all-reduces (after O and after down, every layer) and the logits'
// gather; context parallelism's all-gather of a decode's partial attention outputs.
void add_collectives(std::vector<OperatorCost>& ops, const ModelConfig& m, const ShardShapes& g,
                     const StepSizes& s, std::int64_t tp, std::int64_t cp, double act,
                     const HardwareProfile& p) {
  const std::pair<double, double> link = allreduce_latency_and_bandwidth(p, tp > 1 ? tp : cp);
  const auto add = [&](const char* name, std::int64_t runs, bool per_layer, double bytes) {
    ops.push_back({name,
                   "collectives",
                   runs,
                   {0, bytes},
                   link.first + bytes / (link.second * 1e9),
                   "latency",
                   per_layer});
  };
  const std::int64_t layers = m.num_hidden_layers;
  if (tp > 1) {
    const double t = static_cast<double>(tp);
    add("all_reduce", 2 * layers, true, 2 * (t - 1) / t * s.tokens * g.hidden * act);
    add("logits_gather", 1, false,
        (t - 1) / t * s.logit_rows * static_cast<double>(m.vocab_size) * 4);
  }
  if (cp > 1 && s.decode_tokens > 0) {
    const double q_heads = static_cast<double>(m.num_attention_heads) / static_cast<double>(tp);
    add("attention_all_gather", layers, true,
        static_cast<double>(cp - 1) * s.decode_tokens *
            (q_heads * static_cast<double>(m.value_head_dim()) * act + q_heads * 4));
  }
}

}  // namespace

StepBreakdown CostModel::breakdown(std::span<const EntryShape> batch) const {
  StepBreakdown b;
  b.work = work(batch);
  b.cost = cost(b.work);
  if (b.work.tokens == 0) return b;
  const ModelConfig& m = model_;
  const HardwareProfile& p = profile_;
  const double weight = static_cast<double>(dtype_size(p.compute_dtype)), act = weight;
  const double kv_element = static_cast<double>(dtype_row_bytes(p.kv_dtype, m.cache_head_dim())) /
                            static_cast<double>(m.cache_head_dim());
  const ShardShapes g = sim_detail::shard_shapes(m, tp_, kv_heads_per_gpu_);
  const double kv_token_bytes = 2 * g.kv * kv_element;
  const sim_detail::BatchTally tally = sim_detail::tally_batch(batch);
  const double c = static_cast<double>(cp_);
  StepSizes s;
  s.decode_tokens = static_cast<double>(tally.tokens) - tally.prefill_tokens;
  s.tokens = tally.prefill_tokens / c + s.decode_tokens;
  s.logit_rows = static_cast<double>(tally.logit_rows);
  const std::int64_t layers = m.num_hidden_layers;
  const sim_detail::GroupEfficiencies e = sim_detail::group_efficiencies(b.work, p);
  std::vector<OperatorCost>& ops = b.operators;

  const double rebuilt =  // as work(): a prefill rebuilds its cached keys' K and V (MLA)
      m.is_mla() ? std::max(0.0, tally.prefill_context - tally.prefill_tokens) / c : 0.0;
  add_gemms(ops, sim_detail::layer_gemms(m, g, tp_, s.tokens, rebuilt), layers, weight, act);
  share_group(ops, 0, b.cost.linear_s, p, e.linear, p.gemm_kernel);
  const auto add_group = [&](const char* name, const char* group, std::int64_t runs, bool per_layer,
                             const FlopsAndBytes& w, double group_s, std::pair<double, double> eff,
                             const KernelTerms& kernel) {
    if (w.flops <= 0 && w.bytes <= 0) return;
    ops.push_back({name, group, runs, w, 0, "", per_layer});
    share_group(ops, ops.size() - 1, group_s, p, eff, kernel);
  };
  const double l = static_cast<double>(layers);
  add_group("attention_prefill", "attention_prefill", layers, true,
            {b.work.attention_prefill.flops / l, b.work.attention_prefill.bytes / l},
            b.cost.attention_prefill_s, e.attention_prefill, p.prefill_attention_kernel);
  add_group("attention_decode", "attention_decode", layers, true,
            {b.work.attention_decode.flops / l, b.work.attention_decode.bytes / l},
            b.cost.attention_decode_s, e.attention_decode, p.decode_attention_kernel);
  add_elementwise(ops, g, s, layers, weight, act, kv_token_bytes, p);
  add_group("lm_head", "lm_head", 1, false, b.work.lm_head, b.cost.lm_head_s, e.lm_head,
            p.gemm_kernel);
  add_collectives(ops, m, g, s, tp_, cp_, act, p);
  if (b.cost.ring_s > 0)
    ops.push_back({"ring_transfers", "ring", 1, {0, b.work.ring_bytes}, b.cost.ring_s, "latency"});
  ops.push_back({"step_overhead", "overhead", 1, {}, p.step_overhead_s, "latency"});
  if (b.work.prefill_tokens > 0 && p.ungraphed_step_s > 0)
    ops.push_back({"ungraphed_step", "overhead", 1, {}, p.ungraphed_step_s, "latency"});
  ops.push_back(
      {"sequence_overhead", "overhead", b.work.sequences, {}, p.sequence_overhead_s, "latency"});
  return b;
}

}  // namespace kvlab
