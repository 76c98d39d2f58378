#include "kvlab/sim/cost_model.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kvlab/error.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "step_shapes.hpp"

namespace kvlab {

double roofline_seconds(const FlopsAndBytes& work, double peak_flops, double bytes_per_s,
                        double compute_efficiency, double memory_efficiency) {
  const double compute = work.flops > 0 ? work.flops / (peak_flops * compute_efficiency) : 0.0;
  const double memory = work.bytes > 0 ? work.bytes / (bytes_per_s * memory_efficiency) : 0.0;
  return std::max(compute, memory);
}

double kernel_seconds(const FlopsAndBytes& work, double peak_flops, double bytes_per_s,
                      std::pair<double, double> efficiency, double knee) {
  if (knee <= 0)
    return roofline_seconds(work, peak_flops, bytes_per_s, efficiency.first, efficiency.second);
  const double compute = work.flops > 0 ? work.flops / (peak_flops * efficiency.first) : 0.0;
  const double memory = work.bytes > 0 ? work.bytes / (bytes_per_s * efficiency.second) : 0.0;
  const double larger = std::max(compute, memory);
  if (larger <= 0) return 0.0;
  // Scaled by the larger time, so that neither power overflows or vanishes.
  return larger *
         std::pow(std::pow(compute / larger, knee) + std::pow(memory / larger, knee), 1.0 / knee);
}

double wave_bytes(double bytes, double rows, const HardwareProfile& p) {
  return rows > 0 && rows < p.elementwise_wave_rows ? bytes * p.elementwise_wave_rows / rows
                                                    : bytes;
}

CostModel::CostModel(const ModelConfig& model, const HardwareProfile& profile,
                     std::int64_t tensor_parallel, std::int64_t context_parallel)
    : model_(model),
      profile_(profile),
      tp_(tensor_parallel),
      cp_(context_parallel),
      kv_heads_per_gpu_(
          kv_heads_per_gpu(model.num_attention_heads, model.cache_kv_heads(), tensor_parallel)) {
  if (cp_ < 1) throw Error(fmt::format("context parallelism {} must be >= 1", cp_));
  if (!dtype_row_fits(profile_.kv_dtype, model.cache_head_dim()))
    throw Error(fmt::format("{} KV needs {} to be a multiple of 32 (its blocks); {} has {}",
                            dtype_short_name(profile_.kv_dtype),
                            model.is_mla() ? "half the latent" : "head_dim", model.name,
                            model.cache_head_dim()));
  if ((tp_ > 1 || cp_ > 1) && !(profile_.allreduce_gb_per_s > 0))
    throw Error(fmt::format(
        "{} {} on {}: the profile has no [interconnect] (allreduce_gb_per_s) to price the "
        "transfers between its GPUs",
        tp_ > 1 ? "tensor parallelism" : "context parallelism", tp_ > 1 ? tp_ : cp_,
        profile_.name));
}

using sim_detail::shard_shapes;
using sim_detail::ShardShapes;

StepWork CostModel::work(std::span<const EntryShape> batch) const {
  const ModelConfig& m = model_;
  const double weight = static_cast<double>(dtype_size(profile_.compute_dtype));
  const double act = weight;  // activations in the compute dtype
  // Bytes per KV value, scales included (a quantized format's head row / head_dim).
  const double kv_element =
      static_cast<double>(dtype_row_bytes(profile_.kv_dtype, m.cache_head_dim())) /
      static_cast<double>(m.cache_head_dim());
  const double layers = static_cast<double>(m.num_hidden_layers);
  const ShardShapes g = shard_shapes(m, tp_, kv_heads_per_gpu_);  // one GPU's share
  const double kv_token_bytes = 2 * g.kv * kv_element;            // one layer, K and V

  StepWork w;
  w.sequences = static_cast<std::int64_t>(batch.size());
  const sim_detail::BatchTally tally = sim_detail::tally_batch(batch);
  w.tokens = tally.tokens;
  w.logit_rows = tally.logit_rows;
  w.prefill_tokens = static_cast<std::int64_t>(tally.prefill_tokens);
  // Per layer, on average: a local:global model's local layers see only their window.
  double prefill_pairs = tally.prefill_pairs, decode_context = tally.decode_context;
  double prefill_context = tally.prefill_context;
  if (m.global_layer_every > 0) {
    const sim_detail::LayerTally per_layers = sim_detail::layer_tally(batch, m, tally);
    prefill_pairs = per_layers.prefill_pairs / layers;
    decode_context = per_layers.decode_context / layers;
    prefill_context = per_layers.prefill_context / layers;
  }
  const double prefill_tokens = tally.prefill_tokens;
  if (w.tokens == 0) return w;
  const double logit_rows = static_cast<double>(w.logit_rows);
  // Context parallelism: a GPU computes 1/c of the prefill tokens and pairs, every decode token,
  // and attends over 1/c of each decode's context.
  const double c = static_cast<double>(cp_);
  const double decode_tokens = static_cast<double>(w.tokens) - prefill_tokens;
  const double tokens = prefill_tokens / c + decode_tokens;  // this GPU's
  prefill_pairs /= c;
  decode_context /= c;
  add_context_parallel_work(w, prefill_context, decode_tokens, kv_token_bytes);

  // MLA: a prefill rebuilds its cached keys' K and V (kv_b_proj over their latents).
  const double rebuilt = m.is_mla() ? std::max(0.0, prefill_context - prefill_tokens) / c : 0.0;
  for (const sim_detail::LayerGemm& gemm : sim_detail::layer_gemms(m, g, tp_, tokens, rebuilt)) {
    w.linear.flops += layers * 2 * gemm.rows * gemm.in * gemm.out;
    w.linear.bytes += layers * (gemm.in * gemm.out * gemm.weight_reads * weight +
                                gemm.rows * (gemm.in + gemm.out) * act);
  }
  w.lm_head.flops = 2 * logit_rows * g.hidden * g.vocab;
  w.lm_head.bytes = g.vocab * g.hidden * weight + logit_rows * (g.hidden * act + g.vocab * 4);
  w.attention_prefill.flops = layers * g.prefill_pair_flops * prefill_pairs;
  w.attention_prefill.bytes =  // every K/V chunk passes every GPU of a ring
      layers * (prefill_context * kv_token_bytes + prefill_tokens / c * 2 * g.q * act);
  w.attention_decode.flops = layers * g.decode_pair_flops * decode_context;
  w.attention_decode.bytes =
      layers * (decode_context * kv_token_bytes + decode_tokens * 2 * g.q * act);
  // RMSNorm x2 (read + write hidden), RoPE (q + kv in and out), SwiGLU (2 inter in, inter out),
  // residual x2 (two in, one out), K/V write; then the embedding gather and the final norm.
  w.elementwise.bytes =
      layers * tokens *
          ((10 * g.hidden + 2 * g.q + 2 * g.kv + 3 * g.inter) * act + kv_token_bytes) +
      tokens * g.hidden * (weight + act) + logit_rows * 2 * g.hidden * act;
  count_kernels(w, g, tokens, logit_rows, kv_token_bytes, prefill_pairs, decode_context);
  w.collective_gpus = tp_ > 1 ? tp_ : cp_;
  if (tp_ > 1) {  // all-reduce after O and after down in every layer; the logits gathered
    const double t = static_cast<double>(tp_);
    w.collectives += 2 * m.num_hidden_layers + 1;
    w.collective_bytes += 2 * layers * 2 * (t - 1) / t * tokens * g.hidden * act +
                          (t - 1) / t * logit_rows * static_cast<double>(m.vocab_size) * 4;
  }
  return w;
}

// The element-wise bytes by kind (the terms of elementwise.bytes) and every group's kernels.
void CostModel::count_kernels(StepWork& w, const sim_detail::ShardShapes& g, double tokens,
                              double logit_rows, double kv_token_bytes, double prefill_pairs,
                              double decode_context) const {
  const double act = static_cast<double>(dtype_size(profile_.compute_dtype)), weight = act;
  const double layers = static_cast<double>(model_.num_hidden_layers);
  const std::int64_t l = model_.num_hidden_layers;
  const auto set = [&](ElementwiseKind kind, double bytes, std::int64_t kernels) {
    w.elementwise_bytes[static_cast<std::size_t>(kind)] = bytes;
    w.elementwise_kernels[static_cast<std::size_t>(kind)] = kernels;
  };
  set(ElementwiseKind::rms_norm,
      layers * tokens * 4 * g.hidden * act + logit_rows * 2 * g.hidden * act, 2 * l + 1);
  set(ElementwiseKind::residual_add, layers * tokens * 6 * g.hidden * act, 2 * l);
  set(ElementwiseKind::rope, layers * tokens * (2 * g.q + 2 * g.kv) * act, l);
  set(ElementwiseKind::activation, layers * tokens * 3 * g.inter * act, l);
  set(ElementwiseKind::kv_write, layers * tokens * kv_token_bytes, l);
  set(ElementwiseKind::embedding, tokens * g.hidden * (weight + act), 1);
  w.elementwise_rows = tokens;
  w.gemm_kernels = 4 * l;
  w.prefill_attention_kernels = prefill_pairs > 0 ? l : 0;
  w.decode_attention_kernels = decode_context > 0 ? l : 0;
}

// The ring's K/V hops of a prefill, and the all-gather of a decode's partial attention outputs
// (this GPU's query heads' values and their log-sum-exps, from each of the other c - 1 groups).
void CostModel::add_context_parallel_work(StepWork& w, double prefill_context, double decode_tokens,
                                          double kv_token_bytes) const {
  if (cp_ == 1) return;
  const double c = static_cast<double>(cp_);
  const double layers = static_cast<double>(model_.num_hidden_layers);
  const double act = static_cast<double>(dtype_size(profile_.compute_dtype));
  const double q_heads = static_cast<double>(model_.num_attention_heads) / static_cast<double>(tp_);
  if (prefill_context > 0) {
    w.ring_hops = model_.num_hidden_layers * (cp_ - 1);
    w.ring_bytes = layers * (c - 1) / c * prefill_context * kv_token_bytes;
  }
  if (decode_tokens > 0) {
    w.collectives += model_.num_hidden_layers;
    w.collective_bytes += layers * (c - 1) * decode_tokens *
                          (q_heads * static_cast<double>(model_.head_dim) * act + q_heads * 4);
  }
}

namespace {

// The element-wise group: one efficiency for all bytes, or each kind its own and its floors.
double elementwise_seconds(const StepWork& w, const HardwareProfile& p) {
  const double bandwidth = p.memory_gb_per_s * 1e9;
  if (!has_elementwise_terms(p))
    return w.elementwise.bytes / (bandwidth * p.efficiency.elementwise_memory);
  double seconds = 0;
  for (std::size_t k = 0; k < w.elementwise_bytes.size(); ++k) {
    const ElementwiseTerm& t = p.elementwise[k];
    const double memory = t.memory > 0 ? t.memory : p.efficiency.elementwise_memory;
    seconds += wave_bytes(w.elementwise_bytes[k], w.elementwise_rows, p) / (bandwidth * memory) +
               static_cast<double>(w.elementwise_kernels[k]) * t.floor_s;
  }
  return seconds;
}

double floors(std::int64_t kernels, const KernelTerms& terms) {
  return static_cast<double>(kernels) * terms.floor_s;
}

}  // namespace

StepCost step_cost(const StepWork& w, const HardwareProfile& p) {
  const double peak = p.peak_tflops * 1e12, bandwidth = p.memory_gb_per_s * 1e9;
  StepCost c;
  if (w.tokens == 0) return c;
  const sim_detail::GroupEfficiencies g = sim_detail::group_efficiencies(w, p);
  c.linear_s = kernel_seconds(w.linear, peak, bandwidth, g.linear, p.gemm_kernel.knee) +
               floors(w.gemm_kernels, p.gemm_kernel);
  c.lm_head_s = kernel_seconds(w.lm_head, peak, bandwidth, g.lm_head, p.gemm_kernel.knee) +
                floors(w.logit_rows > 0 ? 1 : 0, p.gemm_kernel);
  c.attention_prefill_s = kernel_seconds(w.attention_prefill, peak, bandwidth, g.attention_prefill,
                                         p.prefill_attention_kernel.knee) +
                          floors(w.prefill_attention_kernels, p.prefill_attention_kernel);
  c.attention_decode_s = kernel_seconds(w.attention_decode, peak, bandwidth, g.attention_decode,
                                        p.decode_attention_kernel.knee) +
                         floors(w.decode_attention_kernels, p.decode_attention_kernel);
  c.elementwise_s = elementwise_seconds(w, p);
  c.overhead_s = p.step_overhead_s + static_cast<double>(w.sequences) * p.sequence_overhead_s +
                 (w.prefill_tokens > 0 ? p.ungraphed_step_s : 0.0);
  if (w.collectives > 0) {
    const auto [latency, gb_per_s] = allreduce_latency_and_bandwidth(p, w.collective_gpus);
    c.collectives_s =
        static_cast<double>(w.collectives) * latency + w.collective_bytes / (gb_per_s * 1e9);
  }
  if (w.ring_hops > 0) {  // ring attention: each hop's transfer hides behind the attention
    const double ring = static_cast<double>(w.ring_hops) * p.allreduce_latency_s +
                        w.ring_bytes / (p.allreduce_gb_per_s * 1e9);
    c.ring_s = std::max(0.0, ring - c.attention_prefill_s);
  }
  return c;
}

StepCost roofline_step_cost(const StepWork& w, const HardwareProfile& p) {
  HardwareProfile peaks;
  peaks.peak_tflops = p.peak_tflops;
  peaks.memory_gb_per_s = p.memory_gb_per_s;
  peaks.efficiency = {1, 1, 1, 1, 1};
  StepWork without_collectives = w;
  without_collectives.collectives = 0;
  without_collectives.ring_hops = 0;
  return step_cost(without_collectives, peaks);
}

StepWork CostModel::work(std::span<const BatchEntry> batch,
                         std::span<const EntryShape> padding) const {
  std::vector<EntryShape> shapes;
  shapes.reserve(batch.size() + padding.size());
  for (const BatchEntry& b : batch) {
    // The keys before the new tokens: a KV policy's view holds fewer than their positions span.
    const std::int64_t cached = b.view.has_holes() ? b.view.index_at_or_after(b.start_position)
                                                   : b.start_position - b.view.first_position;
    shapes.push_back({static_cast<std::int64_t>(b.tokens.size()), b.start_position,
                      b.start_position - std::max<std::int64_t>(0, cached), b.logit_rows});
  }
  shapes.insert(shapes.end(), padding.begin(), padding.end());
  return work(std::span<const EntryShape>(shapes));
}

double CostModel::swap_seconds(std::int64_t bytes, std::int64_t transfers) const {
  const double share = kv_bytes_per_sequence_token_per_gpu() /
                       static_cast<double>(kv_bytes_per_token());  // this GPU's heads, tokens
  return static_cast<double>(transfers) * profile_.swap_latency_s +
         static_cast<double>(bytes) * share / (profile_.swap_gb_per_s * 1e9);
}

double CostModel::disk_seconds(std::int64_t bytes, std::int64_t transfers) const {
  const double share =
      kv_bytes_per_sequence_token_per_gpu() / static_cast<double>(kv_bytes_per_token());
  return static_cast<double>(transfers) * profile_.disk_latency_s +
         static_cast<double>(bytes) * share / (profile_.disk_gb_per_s * 1e9);
}

double CostModel::kv_transfer_seconds(std::int64_t bytes) const {
  const double share =
      kv_bytes_per_sequence_token_per_gpu() / static_cast<double>(kv_bytes_per_token());
  return profile_.kv_transfer_latency_s +
         static_cast<double>(bytes) * share / (profile_.kv_transfer_gb_per_s * 1e9);
}

double CostModel::weight_bytes() const {
  return parameters_per_gpu(model_, tp_) * static_cast<double>(dtype_size(profile_.compute_dtype));
}

std::int64_t CostModel::kv_bytes_per_token() const {
  return 2 * model_.num_hidden_layers * model_.cache_kv_heads() *
         dtype_row_bytes(profile_.kv_dtype, model_.cache_head_dim());
}

std::int64_t CostModel::kv_bytes_per_token_per_gpu() const {
  return 2 * model_.num_hidden_layers * kv_heads_per_gpu_ *
         dtype_row_bytes(profile_.kv_dtype, model_.cache_head_dim());
}

double CostModel::kv_bytes_per_sequence_token_per_gpu() const {
  return static_cast<double>(kv_bytes_per_token_per_gpu()) / static_cast<double>(cp_);
}

std::int64_t CostModel::kv_capacity_tokens() const {  // each group's whole tokens, c groups
  return static_cast<std::int64_t>(std::floor(kv_budget_bytes(profile_, weight_bytes()) /
                                              static_cast<double>(kv_bytes_per_token_per_gpu()))) *
         cp_;
}

}  // namespace kvlab
