#pragma once
// The simulated backend's cost model: how long one engine step takes on a device.
//
// Each operator group is a roofline, max(FLOPs / (peak x e_compute), bytes / (bandwidth x
// e_memory)), and a step is their sum plus fixed overheads:
//   linear       Q/K/V/O projections and the SwiGLU MLP of every layer: 2 x tokens x weights
//                FLOPs; every weight read once per step plus the activations
//   lm_head      one logits row per sequence: 2 x sequences x hidden x vocab FLOPs
//   attention    prefill: 4 x heads x head_dim FLOPs per (query, key) pair, causal; decode:
//                the K/V bytes of the context read once per sequence (memory-bound)
//   elementwise  RMSNorm, RoPE, SwiGLU, residual adds: bytes only
//   overhead     step_s + sequences x sequence_s
//   collectives  tensor parallelism over t GPUs: one GPU's share of all of the above (Megatron:
//                Q/K/V and gate/up split by columns, O and down by rows, the LM head by
//                vocabulary, K/V heads split or one replicated), plus two all-reduces of the
//                hidden states per layer and a gather of the logits over [interconnect]
//   context      context parallelism over c groups of those GPUs: each sequence's KV split by
//   parallel     positions, weights replicated. Prefill (ring attention): each group computes
//                1/c of the chunk's tokens and their query-key pairs, reads every K/V chunk as
//                it passes the ring, and receives (c - 1)/c of the context's K/V per layer over
//                [interconnect], overlapped with the attention it feeds (the step pays the
//                larger). Decode: the new token is computed by every group, each attends over
//                its 1/c of the context, and the partial outputs (and their log-sum-exps) are
//                all-gathered, one collective per layer.
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab {

namespace sim_detail {
struct ShardShapes;
}

// One sequence of a step as the cost model sees it: `new_tokens` at positions
// [start_position, + new_tokens), attending back to first_position (a sliding window releases
// older KV). new_tokens == 1 with a non-empty context is a decode.
struct EntryShape {
  std::int64_t new_tokens = 0;
  std::int64_t start_position = 0;
  std::int64_t first_position = 0;
  std::int64_t logit_rows = 1;  // rows through the LM head (a speculative verify: 1 + proposals)
};

struct FlopsAndBytes {
  double flops = 0;
  double bytes = 0;
};

// What a step asks of the device, before any device speed is applied.
struct StepWork {
  FlopsAndBytes linear, lm_head, attention_prefill, attention_decode, elementwise;
  std::int64_t sequences = 0;
  std::int64_t tokens = 0;
  std::int64_t logit_rows = 0;  // the LM head's rows (sequences, unless a verify asks for more)
  // Tensor parallelism: collectives this step, and the bytes each GPU moves in them (ring
  // all-reduce: 2 (t - 1) / t of the message; gather: (t - 1) / t).
  std::int64_t collectives = 0;
  double collective_bytes = 0;
  // Context parallelism: the ring's hops this step and the K/V bytes each GPU receives in them.
  std::int64_t ring_hops = 0;
  double ring_bytes = 0;
  std::int64_t collective_gpus = 0;  // the GPUs a collective spans (tensor parallel, else context)
  // The element-wise bytes by kind (ElementwiseKind; they add up to elementwise.bytes), and the
  // kernels each group launches (each pays its kind's floor: [kernels], [elementwise]).
  std::array<double, kElementwiseKinds> elementwise_bytes{};
  std::array<std::int64_t, kElementwiseKinds> elementwise_kernels{};
  double elementwise_rows = 0;    // a kernel's rows: this GPU's tokens
  std::int64_t gemm_kernels = 0;  // the layers' projections and MLP (the LM head: one more)
  std::int64_t prefill_attention_kernels = 0, decode_attention_kernels = 0;
  std::int64_t prefill_tokens = 0;  // > 0: the step replays no CUDA graph (ungraphed_step_s)
};

// Seconds per group; total() is the step's latency.
struct StepCost {
  double linear_s = 0, lm_head_s = 0, attention_prefill_s = 0, attention_decode_s = 0,
         elementwise_s = 0, overhead_s = 0, collectives_s = 0;
  double ring_s = 0;  // the ring's transfers beyond the prefill attention they overlap
  double total() const {
    return linear_s + lm_head_s + attention_prefill_s + attention_decode_s + elementwise_s +
           overhead_s + collectives_s + ring_s;
  }
};

// One operator of a step as the cost model prices it (kvlab cost): the StepCost group it is
// part of, how many times a step runs it (a layer's operators: once a layer), one GPU's work and
// seconds a run. Inside a roofline group (linear, lm_head, attention) the group's time is shared
// by each operator's own roofline on the group's efficiencies, so the operators add up to what
// the simulator charges; elementwise, overheads and collectives are priced operator by operator.
struct OperatorCost {
  std::string name;
  std::string group;  // linear, lm_head, attention_prefill, attention_decode, elementwise,
                      // overhead, collectives, ring
  std::int64_t runs = 1;
  FlopsAndBytes work;      // per run
  double seconds = 0;      // per run
  std::string bound;       // compute, memory (its own roofline's side), latency (fixed costs)
  bool per_layer = false;  // run in every layer (runs: layers x its runs a layer)
};

struct StepBreakdown {
  StepWork work;
  StepCost cost;
  std::vector<OperatorCost> operators;  // sum of runs x seconds == cost.total()
};

// A step's latency on a device: needs only the profile (CostModel::cost; calibration fits it).
StepCost step_cost(const StepWork& work, const HardwareProfile& profile);

// The step's roofline on the profile's peaks: every group at efficiency 1 (no kernel regimes),
// no overheads, no collectives; the groups run one after another, as a backend's kernels do,
// so it is the sum of each group's max(FLOPs / peak, bytes / bandwidth). A measured step's
// time over it says how far the backend is from what the hardware allows.
StepCost roofline_step_cost(const StepWork& work, const HardwareProfile& profile);

class CostModel {
 public:
  // `model` as served (its K/V heads after the attention variant's conversion), on
  // `tensor_parallel` x `context_parallel` GPUs of `profile` (either > 1 needs the profile's
  // [interconnect]; kvlab::Error otherwise, or when the GPUs do not divide the heads:
  // kv_heads_per_gpu).
  CostModel(const ModelConfig& model, const HardwareProfile& profile,
            std::int64_t tensor_parallel = 1, std::int64_t context_parallel = 1);

  StepWork work(std::span<const EntryShape> batch) const;
  StepCost cost(const StepWork& work) const { return step_cost(work, profile_); }
  StepCost step(std::span<const EntryShape> batch) const { return cost(work(batch)); }
  // The step operator by operator (kvlab cost; core/src/sim/cost_breakdown.cpp).
  StepBreakdown breakdown(std::span<const EntryShape> batch) const;
  // A step of `batch`, plus `padding`: finished rows a static batch still carries (each a
  // decode of one discarded token after its context).
  StepWork work(std::span<const BatchEntry> batch, std::span<const EntryShape> padding = {}) const;
  StepCost step(std::span<const BatchEntry> batch, std::span<const EntryShape> padding = {}) const {
    return cost(work(batch, padding));
  }
  // `transfers` copies of `bytes` in all over the profile's swap link (with tensor parallelism
  // each GPU moves its heads' share over its own link, at once).
  double swap_seconds(std::int64_t bytes, std::int64_t transfers) const;
  // `transfers` reads or writes of `bytes` in all on the KV disk tier's storage.
  double disk_seconds(std::int64_t bytes, std::int64_t transfers) const;
  // One KV handoff of `bytes` (all GPUs' share) from a prefill replica to a decode replica over
  // the profile's [network].
  double kv_transfer_seconds(std::int64_t bytes) const;

  // Memory, one GPU's: its parameters x compute dtype; K and V of one token in every layer for
  // its K/V heads; and the tokens of KV that fit in memory_gib x utilization - weights -
  // activation reserve (0 when nothing fits). kv_bytes_per_token: every GPU's together.
  // With context parallelism a GPU holds 1/c of each sequence's tokens: the per-GPU bytes of a
  // sequence's token are kv_bytes_per_token_per_gpu() / c, and the tokens that fit c times more.
  double weight_bytes() const;
  std::int64_t kv_bytes_per_token() const;
  std::int64_t kv_bytes_per_token_per_gpu() const;
  double kv_bytes_per_sequence_token_per_gpu() const;
  std::int64_t kv_capacity_tokens() const;

  const HardwareProfile& profile() const { return profile_; }
  const ModelConfig& model() const { return model_; }
  std::int64_t tensor_parallel() const { return tp_; }
  std::int64_t context_parallel() const { return cp_; }

 private:
  void count_kernels(StepWork& w, const sim_detail::ShardShapes& g, double tokens,
                     double logit_rows, double kv_token_bytes, double prefill_pairs,
                     double decode_context) const;
  void add_context_parallel_work(StepWork& w, double prefill_context, double decode_sequences,
                                 double kv_token_bytes) const;
  ModelConfig model_;
  HardwareProfile profile_;
  std::int64_t tp_ = 1;
  std::int64_t cp_ = 1;
  std::int64_t kv_heads_per_gpu_ = 0;
};

// The roofline time of one group: max(flops / (peak x e_c), bytes / (bandwidth x e_m)).
double roofline_seconds(const FlopsAndBytes& work, double peak_flops, double bytes_per_s,
                        double compute_efficiency, double memory_efficiency);
// The same two times joined at `knee` (KernelTerms::knee): (c^k + m^k)^(1/k); 0: their max.
double kernel_seconds(const FlopsAndBytes& work, double peak_flops, double bytes_per_s,
                      std::pair<double, double> efficiency, double knee);
// An element-wise kernel's bytes as its time counts them: a kernel of fewer than
// elementwise_wave_rows rows takes as long as that many.
double wave_bytes(double bytes, double rows, const HardwareProfile& profile);

}  // namespace kvlab
