// The simulated backend's pieces: the cost model against hand-computed rooflines, hardware
// profile files (shipped ones load, every file error is clear), the calibration fit, and the
// synthetic tokens.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "kvlab/error.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/calibration.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/sim/step_spec.hpp"
#include "kvlab/sim/swap_link.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

// A small model whose arithmetic is easy to follow by hand.
ModelConfig toy_model() {
  ModelConfig m;
  m.name = "toy";
  m.vocab_size = 100;
  m.hidden_size = 64;
  m.intermediate_size = 128;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 16;
  m.max_position_embeddings = 512;
  return m;
}

HardwareProfile toy_profile() {
  HardwareProfile p;
  p.name = "toy";
  p.peak_tflops = 1.0;        // 1e12 FLOP/s
  p.memory_gb_per_s = 100.0;  // 1e11 B/s
  p.memory_gib = 1.0;
  p.compute_dtype = DType::dtype_bf16;  // 2 bytes
  p.kv_dtype = DType::dtype_f32;        // 4 bytes
  p.efficiency = {0.5, 0.5, 0.25, 0.5, 0.5};
  p.step_overhead_s = 1e-3;
  p.sequence_overhead_s = 1e-5;
  p.memory_utilization = 1.0;
  p.activation_reserve_gib = 0.0;
  p.swap_gb_per_s = 25.0;  // 2.5e10 B/s
  p.swap_latency_s = 7e-6;
  return p;
}

constexpr double kRel = 1e-12;  // the model is closed-form: only rounding differs

TEST(CostModel, DecodeOfOneSequenceMatchesTheHandRoofline) {
  const CostModel model(toy_model(), toy_profile());
  // One decode at position 9: attends to 10 keys (0..9).
  const EntryShape decode{1, 9, 0};
  const StepWork w = model.work(std::span(&decode, 1));
  // Per layer weights: 64*(64 + 2*32) + 64*64 + 3*64*128 = 8192 + 4096 + 24576 = 36864.
  EXPECT_DOUBLE_EQ(w.linear.flops, 2.0 * 1 * 36864 * 2);
  // Weights (2 B) + activations per token per layer (4*64 + 2*64 + 2*32 + 3*128 = 832 elements).
  EXPECT_DOUBLE_EQ(w.linear.bytes, 2 * (36864 * 2.0 + 832 * 2.0));
  // 4 x q_dim FLOPs per (query, key) pair, 10 pairs, 2 layers; K/V bytes: 10 tokens x 2 x 32 x 4.
  EXPECT_DOUBLE_EQ(w.attention_decode.flops, 2 * 4.0 * 64 * 10);
  EXPECT_DOUBLE_EQ(w.attention_decode.bytes, 2 * (10 * 2 * 32 * 4.0 + 1 * 2 * 64 * 2.0));
  EXPECT_DOUBLE_EQ(w.attention_prefill.flops, 0);
  EXPECT_DOUBLE_EQ(w.lm_head.flops, 2.0 * 64 * 100);
  EXPECT_DOUBLE_EQ(w.lm_head.bytes, 100 * 64 * 2.0 + (64 * 2.0 + 100 * 4.0));

  const StepCost c = model.cost(w);
  // Memory-bound: bytes / (1e11 x 0.5) beats flops / (1e12 x 0.5).
  EXPECT_NEAR(c.linear_s, w.linear.bytes / 5e10, kRel);
  EXPECT_NEAR(c.attention_decode_s, w.attention_decode.bytes / 5e10, kRel);
  EXPECT_NEAR(c.overhead_s, 1e-3 + 1e-5, kRel);
  EXPECT_NEAR(c.total(),
              c.linear_s + c.lm_head_s + c.attention_decode_s + c.elementwise_s + c.overhead_s,
              kRel);
}

// A KV policy's view (positions 0-2 and 50-59 kept, the new token at 60) is priced by the 13
// keys it holds, as a contiguous view of 13 cached positions would be, not by the 60 its
// positions span.
TEST(CostModel, ViewsWithHolesArePricedByTheKeysTheyHold) {
  const CostModel model(toy_model(), toy_profile());
  const std::int32_t token = 1;
  BatchEntry holed{
      {&token, 1}, 60, {{{0, 14}}, 0, {0, 1, 2, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60}}};
  BatchEntry contiguous{{&token, 1}, 13, {{{0, 14}}, 0, {}}};
  const StepWork a = model.work(std::span(&holed, 1), {});
  const StepWork b = model.work(std::span(&contiguous, 1), {});
  EXPECT_DOUBLE_EQ(a.attention_decode.flops, b.attention_decode.flops);
  EXPECT_DOUBLE_EQ(a.attention_decode.bytes, b.attention_decode.bytes);
  EXPECT_DOUBLE_EQ(a.attention_decode.flops, 2 * 4.0 * 64 * 14);  // 14 (query, key) pairs
}

TEST(CostModel, LargePrefillTurnsComputeBoundAndCountsCausalPairs) {
  const CostModel model(toy_model(), toy_profile());
  const EntryShape prefill{4096, 0, 0};
  const StepWork w = model.work(std::span(&prefill, 1));
  // Causal pairs: n(n+1)/2.
  EXPECT_DOUBLE_EQ(w.attention_prefill.flops, 2 * 4.0 * 64 * (4096.0 * 4097 / 2));
  const StepCost c = model.cost(w);
  EXPECT_NEAR(c.linear_s, w.linear.flops / (1e12 * 0.5), kRel);  // compute-bound now
  EXPECT_NEAR(c.attention_prefill_s, w.attention_prefill.flops / (1e12 * 0.25), kRel);
  // A later chunk: 8 tokens after 100 cached ones attend to 100 + i + 1 keys each.
  const EntryShape chunk{8, 100, 0};
  EXPECT_DOUBLE_EQ(model.work(std::span(&chunk, 1)).attention_prefill.flops,
                   2 * 4.0 * 64 * (8 * 100.0 + 8 * 9 / 2.0));
  // Sliding window: the view starts at 60, so the same chunk sees 40 cached keys.
  const EntryShape windowed{8, 100, 60};
  EXPECT_DOUBLE_EQ(model.work(std::span(&windowed, 1)).attention_prefill.flops,
                   2 * 4.0 * 64 * (8 * 40.0 + 8 * 9 / 2.0));
}

// A speculative verify: the newest token and k proposals after a cached context, priced as the
// chunk it is (k + 1 tokens through the weights, each attending to the cache and the tokens
// before it) with k + 1 rows through the LM head.
TEST(CostModel, AVerifyEntryIsPricedAsItsTokensWithARowOfLogitsEach) {
  const CostModel model(toy_model(), toy_profile());
  const EntryShape decode{1, 100, 0};
  const EntryShape verify{5, 100, 0, 5};
  const StepWork one = model.work(std::span(&decode, 1)), five = model.work(std::span(&verify, 1));
  EXPECT_EQ(five.tokens, 5);
  EXPECT_EQ(five.logit_rows, 5);
  EXPECT_DOUBLE_EQ(five.linear.flops, 5 * one.linear.flops);
  EXPECT_DOUBLE_EQ(five.lm_head.flops, 5 * one.lm_head.flops);
  EXPECT_DOUBLE_EQ(five.attention_prefill.flops, 2 * 4.0 * 64 * (5 * 100.0 + 5 * 6 / 2.0));
  // A prompt chunk of 5 wants one row of logits: its LM head is a decode's.
  const EntryShape chunk{5, 100, 0};
  EXPECT_DOUBLE_EQ(model.work(std::span(&chunk, 1)).lm_head.flops, one.lm_head.flops);
}

// The roofline a measured step is set against (kvlab calibrate): every group at the peaks,
// whatever the profile's efficiencies, regimes and overheads say.
TEST(CostModel, RooflineIsEveryGroupAtThePeaksWithoutOverheads) {
  const CostModel model(toy_model(), toy_profile());
  const std::vector<EntryShape> decodes(64, EntryShape{1, 511, 0});
  const StepWork w = model.work(decodes);
  const StepCost r = roofline_step_cost(w, toy_profile());
  // The balance point is 1e12 / 1e11 = 10 FLOP per byte. The products do 2 x 64 FLOPs per
  // 2-byte weight (64 FLOP/B): compute-bound at the peak. Decode attention does 4 x 64 FLOPs per
  // key against its 2 x 32 f32 K/V elements (256 B): 1 FLOP/B, memory-bound.
  EXPECT_NEAR(r.linear_s, w.linear.flops / 1e12, kRel);
  EXPECT_NEAR(r.lm_head_s, w.lm_head.flops / 1e12, kRel);
  EXPECT_NEAR(r.attention_decode_s, w.attention_decode.bytes / 1e11, kRel);
  EXPECT_NEAR(r.elementwise_s, w.elementwise.bytes / 1e11, kRel);
  EXPECT_EQ(r.overhead_s, 0);
  EXPECT_NEAR(r.total(),
              (w.linear.flops + w.lm_head.flops) / 1e12 +
                  (w.attention_decode.bytes + w.elementwise.bytes) / 1e11,
              kRel);
  // The fitted step is slower (efficiencies <= 1, overheads >= 0) and the roofline ignores what
  // the fit changes.
  EXPECT_GT(model.cost(w).total(), r.total());
  HardwareProfile fitted = toy_profile();
  fitted.efficiency = {0.1, 0.2, 0.3, 0.4, 0.5};
  fitted.gemm_regimes = {{2, 0.05, 0.05}};
  fitted.step_overhead_s = 1;
  EXPECT_DOUBLE_EQ(roofline_step_cost(w, fitted).total(), r.total());
  // A long prefill is compute-bound on the same peaks: FLOPs / 1e12.
  const EntryShape prefill{4096, 0, 0};
  const StepWork p = model.work(std::span(&prefill, 1));
  EXPECT_NEAR(roofline_step_cost(p, toy_profile()).attention_prefill_s,
              p.attention_prefill.flops / 1e12, kRel);
}

TEST(CostModel, SwapIsLatencyPerCopyPlusBytesOverTheLink) {
  const CostModel cost(toy_model(), toy_profile());
  EXPECT_EQ(cost.swap_seconds(0, 0), 0.0);
  EXPECT_NEAR(cost.swap_seconds(5'000'000, 2), 2 * 7e-6 + 5e6 / 2.5e10, kRel);
}

// A static batch's padding row costs what a decode of one token after its context costs.
TEST(CostModel, PaddingRowsArePricedAsDecodes) {
  const CostModel cost(toy_model(), toy_profile());
  const std::vector<std::int32_t> tokens{1};
  BatchEntry running;
  running.tokens = tokens;
  running.start_position = 40;
  running.view.extents = {{0, 41}};
  const std::vector<BatchEntry> batch{running};
  const std::vector<EntryShape> padding{{1, 100, 0}, {1, 7, 0}};
  const std::vector<EntryShape> all{{1, 40, 0}, {1, 100, 0}, {1, 7, 0}};
  EXPECT_NEAR(cost.step(batch, padding).total(), cost.step(all).total(), kRel);
  EXPECT_GT(cost.step(batch, padding).total(), cost.step(batch).total());
}

TEST(CostModel, KernelRegimesTakeOverFromTheirMinRows) {
  HardwareProfile p = toy_profile();
  p.gemm_regimes = {{3, 0.05, 0.05}, {6, 0.25, 0.25}};  // slow from 3 rows, faster from 6
  p.decode_attention_regimes = {{4, 0.5, 0.01}};
  const CostModel plain(toy_model(), toy_profile()), regimes(toy_model(), p);
  auto decodes = [](std::int64_t n) {
    return std::vector<EntryShape>(static_cast<std::size_t>(n), EntryShape{1, 99, 0});
  };
  for (std::int64_t n = 1; n <= 8; ++n) {
    const StepWork w = plain.work(decodes(n));
    const StepCost base = plain.cost(w), with = regimes.cost(w);
    // Rows of the projections are tokens, of the LM head sequences: here both are n.
    const double gemm = n >= 6 ? 0.25 : n >= 3 ? 0.05 : 0.5;  // toy base: 0.5
    EXPECT_NEAR(with.linear_s, base.linear_s * 0.5 / gemm, kRel * base.linear_s) << n;
    EXPECT_NEAR(with.lm_head_s, base.lm_head_s * 0.5 / gemm, kRel * base.lm_head_s) << n;
    const double attention = n >= 4 ? 0.01 : 0.5;  // memory-bound decode attention
    EXPECT_NEAR(with.attention_decode_s, base.attention_decode_s * 0.5 / attention,
                kRel * with.attention_decode_s)
        << n;
    EXPECT_NEAR(with.elementwise_s, base.elementwise_s, kRel * base.elementwise_s) << n;
  }
  EXPECT_EQ(regime_efficiency(p.gemm_regimes, 2, {0.7, 0.8}), std::make_pair(0.7, 0.8));
  EXPECT_EQ(regime_efficiency(p.gemm_regimes, 5, {0.7, 0.8}), std::make_pair(0.05, 0.05));
  EXPECT_EQ(regime_efficiency(p.gemm_regimes, 100, {0.7, 0.8}), std::make_pair(0.25, 0.25));
}

TEST(CostModel, TensorParallelSplitsTheWorkAndAddsTheAllReduces) {
  HardwareProfile p = toy_profile();
  p.allreduce_gb_per_s = 50.0;  // 5e10 B/s
  p.allreduce_latency_s = 2e-6;
  const ModelConfig m = toy_model();  // 4 query heads, 2 K/V heads, head_dim 16, hidden 64
  const CostModel one(m, p), two(m, p, 2), four(m, p, 4);
  const std::vector<EntryShape> batch{{32, 0, 0}, {1, 99, 0}, {1, 40, 0}};
  const StepWork w1 = one.work(batch), w2 = two.work(batch), w4 = four.work(batch);
  EXPECT_DOUBLE_EQ(w2.linear.flops, w1.linear.flops / 2);  // every matrix split in two
  EXPECT_DOUBLE_EQ(w2.lm_head.flops, w1.lm_head.flops / 2);
  EXPECT_DOUBLE_EQ(w2.attention_prefill.flops, w1.attention_prefill.flops / 2);
  // K/V heads: 2 over 2 GPUs is one each; over 4 GPUs one each, replicated (not a half).
  EXPECT_EQ(two.kv_bytes_per_token_per_gpu() * 2, one.kv_bytes_per_token_per_gpu());
  EXPECT_EQ(four.kv_bytes_per_token_per_gpu(), two.kv_bytes_per_token_per_gpu());
  EXPECT_EQ(four.kv_bytes_per_token(), one.kv_bytes_per_token());  // the whole model's
  // Two all-reduces of (tokens x hidden) per layer and one gather of the logits.
  EXPECT_EQ(w1.collectives, 0);
  EXPECT_EQ(w2.collectives, 2 * 2 + 1);
  const double tokens = 34, hidden = 64, act = 2, vocab = 100, sequences = 3;
  EXPECT_DOUBLE_EQ(w2.collective_bytes,
                   2 * 2 * (2 * 0.5 * tokens * hidden * act) + 0.5 * sequences * vocab * 4);
  EXPECT_DOUBLE_EQ(w4.collective_bytes,
                   2 * 2 * (2 * 0.75 * tokens * hidden * act) + 0.75 * sequences * vocab * 4);
  const StepCost c2 = two.cost(w2);
  EXPECT_NEAR(c2.collectives_s, 5 * 2e-6 + w2.collective_bytes / 5e10, kRel);
  EXPECT_NEAR(c2.total() - c2.collectives_s,
              c2.linear_s + c2.lm_head_s + c2.attention_prefill_s + c2.attention_decode_s +
                  c2.elementwise_s + c2.overhead_s,
              kRel);
  EXPECT_LT(two.weight_bytes(), one.weight_bytes() / 2 * 1.2);
  EXPECT_GT(two.weight_bytes(), one.weight_bytes() / 2);  // norms stay whole on every GPU
  EXPECT_GT(two.kv_capacity_tokens(), one.kv_capacity_tokens());
  // A swap moves each GPU's share over its own link at once.
  EXPECT_NEAR(two.swap_seconds(1 << 20, 1) - p.swap_latency_s,
              (one.swap_seconds(1 << 20, 1) - p.swap_latency_s) / 2, kRel);

  test::expect_error_containing([&] { CostModel(m, toy_profile(), 2); },
                                {"tensor parallelism 2 on toy", "[interconnect]"});
  test::expect_error_containing([&] { CostModel(m, p, 3); },
                                {"tensor parallelism 3 does not divide the 4 query heads"});
  ModelConfig three_kv = m;
  three_kv.num_attention_heads = 12;
  three_kv.num_key_value_heads = 3;
  test::expect_error_containing([&] { CostModel(three_kv, p, 4); },
                                {"tensor parallelism 4 and the 3 K/V heads must divide"});
}

// Context parallelism over c groups: a prefill's tokens and pairs split c ways (the K/V it reads
// not: every chunk passes every GPU), the ring's hops and (c - 1)/c of the context's K/V per
// layer hidden behind the attention they feed; a decode computed on every group, its context's
// K/V read 1/c each, partial outputs all-gathered once per layer; c times the tokens fit.
TEST(CostModel, ContextParallelSplitsSequencesByPositions) {
  HardwareProfile p = toy_profile();
  p.allreduce_gb_per_s = 50.0;  // 5e10 B/s
  p.allreduce_latency_s = 2e-6;
  const ModelConfig m = toy_model();  // 2 layers, 4 query heads, 2 K/V heads, head_dim 16
  const CostModel one(m, p), four(m, p, 1, 4);
  const std::vector<EntryShape> prefill{{64, 0, 0}};
  const StepWork p1 = one.work(prefill), p4 = four.work(prefill);
  EXPECT_DOUBLE_EQ(p4.linear.flops, p1.linear.flops / 4);
  EXPECT_DOUBLE_EQ(p4.attention_prefill.flops, p1.attention_prefill.flops / 4);
  const double kv_token_bytes = 2 * 2 * 16 * 4;  // one layer: K and V, 2 heads x 16, f32
  EXPECT_DOUBLE_EQ(p4.attention_prefill.bytes - p1.attention_prefill.bytes,
                   -2 * 64 * 0.75 * 2 * 64 * 2);  // only the queries' reads shrink
  EXPECT_EQ(p4.ring_hops, 2 * 3);
  EXPECT_DOUBLE_EQ(p4.ring_bytes, 2 * 0.75 * 64 * kv_token_bytes);
  EXPECT_EQ(p1.ring_hops, 0);
  const StepCost c4 = four.cost(p4);
  const double ring = 6 * 2e-6 + p4.ring_bytes / 5e10;
  EXPECT_NEAR(c4.ring_s, std::max(0.0, ring - c4.attention_prefill_s), kRel);
  const std::vector<EntryShape> decode{{1, 99, 0}, {1, 40, 0}};
  const StepWork d1 = one.work(decode), d4 = four.work(decode);
  EXPECT_DOUBLE_EQ(d4.linear.flops, d1.linear.flops);  // every group computes the new token
  EXPECT_DOUBLE_EQ(d4.attention_decode.flops, d1.attention_decode.flops / 4);
  EXPECT_EQ(d4.collectives, 2);  // one all-gather per layer
  EXPECT_DOUBLE_EQ(d4.collective_bytes, 2 * 3 * 2 * (4 * 16 * 2 + 4 * 4));
  EXPECT_EQ(d4.ring_hops, 0);
  EXPECT_EQ(four.kv_capacity_tokens(), one.kv_capacity_tokens() * 4);
  EXPECT_DOUBLE_EQ(four.kv_bytes_per_sequence_token_per_gpu(),
                   one.kv_bytes_per_token_per_gpu() / 4.0);
  EXPECT_NEAR(four.swap_seconds(1 << 20, 1) - p.swap_latency_s,
              (one.swap_seconds(1 << 20, 1) - p.swap_latency_s) / 4, kRel);
  test::expect_error_containing([&] { CostModel(m, toy_profile(), 1, 2); },
                                {"context parallelism 2 on toy", "[interconnect]"});
  test::expect_error_containing([&] { CostModel(m, p, 1, 0); }, {"context parallelism 0"});
}

// The planner: c groups hold c times the tokens (each GPU 1/c of every request's).
TEST(MemoryPlanner, ContextParallelHoldsMoreTokensOfEachRequest) {
  const ModelConfig llama = model_preset("llama3.1-8b");
  const HardwareProfile h200 = load_hardware_profile("h200");
  MemoryPlanQuery q;
  q.prompt_tokens = 126195;
  q.output_tokens = 332;
  const MemoryPlan one = plan_memory(llama, h200, q);
  q.context_parallel = 4;
  const MemoryPlan four = plan_memory(llama, h200, q);
  EXPECT_EQ(four.kv_capacity_tokens, one.kv_capacity_tokens * 4);
  EXPECT_EQ(four.kv_bytes_per_token, one.kv_bytes_per_token);  // of a token on its GPU
  EXPECT_GE(four.max_paged_requests, 4 * one.max_paged_requests);
  q.context_parallel = 0;
  test::expect_error_containing([&] { (void)plan_memory(llama, h200, q); },
                                {"context parallelism must be >= 1"});
}

TEST(CostModel, EmptyStepCostsNothing) {
  const CostModel model(toy_model(), toy_profile());
  EXPECT_EQ(model.step(std::span<const EntryShape>{}).total(), 0.0);
}

// One kernel's time: compute c and memory m joined at the knee k ((c^k + m^k)^(1/k); k = 0: the
// plain roofline's max), floor apart.
double joined(double c, double m, double k) {
  return k == 0 ? std::max(c, m) : std::pow(std::pow(c, k) + std::pow(m, k), 1 / k);
}

TEST(CostModel, Llama2_7bOnH200DecodeIsTheWeightRead) {
  const HardwareProfile h200 = load_hardware_profile("h200");
  const ModelConfig llama = model_preset("llama2-7b");
  const CostModel model(llama, h200);
  const EntryShape decode{1, 511, 0};
  const StepCost c = model.step(std::span(&decode, 1));
  const Efficiency& e = h200.efficiency;
  // Weights of the layers: 32 x (4096 x 3 x 4096 + 4096^2 + 3 x 4096 x 11008) x 2 B, read at the
  // GEMMs' memory fraction; one token's FLOPs (2 a weight: as many as the bytes) at their compute
  // fraction, joined at the fitted knee; and 4 GEMM kernels a layer, each its floor.
  const double layer_bytes = 32.0 * (4096.0 * 3 * 4096 + 4096.0 * 4096 + 3.0 * 4096 * 11008) * 2;
  ASSERT_GT(h200.gemm_kernel.floor_s, 0);
  EXPECT_NEAR(c.linear_s,
              joined(layer_bytes / (989e12 * e.gemm_compute),
                     layer_bytes / (4800e9 * e.gemm_memory), h200.gemm_kernel.knee) +
                  4 * 32 * h200.gemm_kernel.floor_s,
              1e-3 * c.linear_s);  // activations add < 0.1%
  // KV: 512 tokens x 32 layers x 2 x 4096 x 2 B read at the attention bandwidth, beside 512 x 32
  // x 4 x 4096 FLOPs (QK and PV), one kernel a layer.
  EXPECT_NEAR(c.attention_decode_s,
              joined(512.0 * 32 * 4 * 4096 / (989e12 * e.attention_compute),
                     512.0 * 32 * 2 * 4096 * 2 / (4800e9 * e.attention_memory),
                     h200.decode_attention_kernel.knee) +
                  32 * h200.decode_attention_kernel.floor_s,
              1e-2 * c.attention_decode_s);
  // About 3 ms for one token of a 7B model on an H200: the well-known memory-bound decode.
  EXPECT_GT(c.total(), 3e-3);
  EXPECT_LT(c.total(), 8e-3);
}

TEST(CostModel, KvCapacityIsMemoryMinusWeightsAndReserve) {
  const HardwareProfile h200 = load_hardware_profile("h200");
  const CostModel model(model_preset("llama2-7b"), h200);
  EXPECT_EQ(model.kv_bytes_per_token(), 2 * 32 * 4096 * 2);  // 512 KiB
  const double gib = 1024.0 * 1024 * 1024;
  const double free = 140 * 0.9 * gib - 6'738'415'616.0 * 2 - 2 * gib;
  EXPECT_EQ(model.kv_capacity_tokens(), static_cast<std::int64_t>(free / (512 * 1024)));
  // LLaMA-65B in bf16 (130 GB of weights) does not fit on one 80 GiB H100.
  const CostModel too_big(model_preset("llama-65b"), load_hardware_profile("h100-sxm"));
  EXPECT_EQ(too_big.kv_capacity_tokens(), 0);
}

TEST(HardwareProfiles, ShippedProfilesLoadByNameInAnyCase) {
  for (const char* name :
       {"a100-80gb", "h100-sxm", "h200", "h200-measured", "l4", "cpu", "H200", "A100-80GB"}) {
    const HardwareProfile p = load_hardware_profile(name);
    EXPECT_GT(p.peak_tflops, 0) << name;
    EXPECT_GT(p.memory_gb_per_s, 0) << name;
    EXPECT_GT(p.memory_gib, 0) << name;
    // Every shipped profile states its swap link (the struct's defaults are not a device).
    std::ifstream file(p.source);
    const std::string text((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\n[link]\n"), std::string::npos) << name;
    EXPECT_NE(text.find("\nswap_gb_per_s = "), std::string::npos) << name;
    EXPECT_NE(text.find("\nswap_latency_s = "), std::string::npos) << name;
  }
  EXPECT_EQ(load_hardware_profile("cpu").compute_dtype, DType::dtype_f32);
  EXPECT_DOUBLE_EQ(load_hardware_profile("h200").memory_gb_per_s, 4800);
  EXPECT_DOUBLE_EQ(load_hardware_profile("a100-80gb").peak_tflops, 312);
  const auto names = hardware_profile_names();
  for (const char* name : {"a100-80gb", "h100-sxm", "h200", "h200-measured", "l4"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
}

TEST(HardwareProfiles, UnknownNameListsProfilesAndSuggests) {
  test::expect_error_containing([] { load_hardware_profile("h20"); },
                                {"unknown hardware profile \"h20\"", "did you mean h200", "l4"});
}

TEST(HardwareProfiles, RoundTripThroughToml) {
  test::TempDir dir;
  HardwareProfile p = toy_profile();
  p.description = "quotes \" and \\ survive";
  const auto file = dir.path() / "toy.toml";
  std::ofstream(file) << hardware_profile_to_toml(p);
  const HardwareProfile q = load_hardware_profile_file(file);
  EXPECT_EQ(q.name, p.name);
  EXPECT_EQ(q.description, p.description);
  EXPECT_DOUBLE_EQ(q.peak_tflops, p.peak_tflops);
  EXPECT_DOUBLE_EQ(q.efficiency.attention_compute, p.efficiency.attention_compute);
  EXPECT_DOUBLE_EQ(q.step_overhead_s, p.step_overhead_s);
  EXPECT_EQ(q.kv_dtype, DType::dtype_f32);
  EXPECT_DOUBLE_EQ(q.activation_reserve_gib, 0.0);
  EXPECT_DOUBLE_EQ(q.swap_gb_per_s, p.swap_gb_per_s);
  EXPECT_DOUBLE_EQ(q.swap_latency_s, p.swap_latency_s);
  EXPECT_TRUE(q.gemm_regimes.empty());
  EXPECT_EQ(load_hardware_profile(file.string()).name, "toy");  // a path works too

  p.allreduce_gb_per_s = 360;
  p.allreduce_latency_s = 8e-6;
  p.gemm_regimes = {{5, 0.3, 0.4}, {65, 0.9, 0.6}};
  p.decode_attention_regimes = {{8, 0.5, 0.2}};
  std::ofstream(file, std::ios::trunc) << hardware_profile_to_toml(p);
  const HardwareProfile r = load_hardware_profile_file(file);
  ASSERT_EQ(r.gemm_regimes.size(), 2u);
  EXPECT_EQ(r.gemm_regimes[1].min_rows, 65);
  EXPECT_DOUBLE_EQ(r.gemm_regimes[1].compute, 0.9);
  EXPECT_DOUBLE_EQ(r.gemm_regimes[0].memory, 0.4);
  ASSERT_EQ(r.decode_attention_regimes.size(), 1u);
  EXPECT_EQ(r.decode_attention_regimes[0].min_rows, 8);
  EXPECT_DOUBLE_EQ(r.decode_attention_regimes[0].memory, 0.2);
  EXPECT_DOUBLE_EQ(r.allreduce_gb_per_s, 360);
  EXPECT_DOUBLE_EQ(r.allreduce_latency_s, 8e-6);
}

TEST(HardwareProfiles, FileErrorsNameTheLineAndTheKey) {
  test::TempDir dir;
  const std::string good =
      "[profile]\nname = \"x\"\n[device]\npeak_tflops = 1\nmemory_gb_per_s = 2\nmemory_gib = 3\n";
  auto expect = [&](const std::string& text, std::vector<std::string> parts) {
    const auto file = dir.path() / "p.toml";
    std::ofstream(file, std::ios::trunc) << text;
    test::expect_error_containing([&] { load_hardware_profile_file(file); }, parts);
  };
  EXPECT_NO_THROW({
    std::ofstream(dir.path() / "ok.toml") << good;
    load_hardware_profile_file(dir.path() / "ok.toml");
  });
  expect("[profile]\nname = \"x\"\n[device]\npeak_tflops = 1\nmemory_gib = 3\n",
         {"p.toml", "[device] needs memory_gb_per_s"});
  expect(good + "peak_tflop = 2\n", {"p.toml:7", "unknown key device.peak_tflop", "peak_tflops"});
  expect(good + "[efficiency]\ngemm_compute = 1.5\n", {"p.toml:8", "(0, 1]", "1.5"});
  expect(good + "[efficiency]\ngemm_memory = -1\n", {"p.toml:8", "must be > 0"});
  expect(good + "[efficiency]\ngemm_memory = \"high\"\n", {"p.toml:8", "must be a number"});
  expect(good + "[device2]\n", {"p.toml:7", "unknown table [device2]", "did you mean [device]"});
  expect("[profile\nname = 1", {"p.toml:1"});
  expect(good + "[memory]\nutilization = 0\n", {"memory.utilization must be > 0"});
  expect(good + "[link]\nswap_gb_per_s = 0\n", {"p.toml:8", "link.swap_gb_per_s must be > 0"});
  expect(good + "[link]\nswap_latency_s = -1\n", {"link.swap_latency_s must be >= 0"});
  expect(good + "[interconnect]\nallreduce_latency_s = 1e-5\n",
         {"[interconnect] needs allreduce_gb_per_s"});
  expect(good + "[interconnect]\nallreduce_gb_per_s = 0\n",
         {"p.toml:8", "interconnect.allreduce_gb_per_s must be > 0"});
  const std::string regime = "[[gemm_regime]]\nmin_rows = 5\ncompute = 0.5\nmemory = 0.5\n";
  EXPECT_NO_THROW({
    std::ofstream(dir.path() / "ok.toml", std::ios::trunc) << good + regime;
    load_hardware_profile_file(dir.path() / "ok.toml");
  });
  expect(good + "[gemm_regime]\nmin_rows = 5\n",
         {"p.toml:7", "gemm_regime must be an array of tables ([[gemm_regime]])"});
  expect(good + "[[gemm_regime]]\nmin_rows = 5\ncompute = 0.5\n",
         {"p.toml:7", "a gemm_regime needs min_rows, compute and memory"});
  expect(good + "[[decode_attention_regime]]\nmin_rows = 1\ncompute = 0.5\nmemory = 0.5\n",
         {"p.toml:8", "decode_attention_regime.min_rows must be an integer in [2, 1e9], got 1"});
  expect(good + regime + "[[gemm_regime]]\nmin_rows = 4.5\ncompute = 0.5\nmemory = 0.5\n",
         {"p.toml:12", "gemm_regime.min_rows must be an integer"});
  expect(good + regime + regime, {"p.toml:12", "gemm_regime.min_rows must ascend: 5 after 5"});
  expect(good + "[[gemm_regime]]\nmin_rows = 5\ncompute = 1.5\nmemory = 0.5\n",
         {"p.toml:9", "gemm_regime.compute is a fraction of the peak: (0, 1], got 1.5"});
  expect(good + "[[gemm_regime]]\nmin_rows = 5\ncompute = 0.5\nmemory = 0.5\nspeed = 1\n",
         {"p.toml:11", "unknown key gemm_regime.speed"});
  test::expect_error_containing([&] { load_hardware_profile_file(dir.path() / "none.toml"); },
                                {"none.toml", "no such file"});
}

TEST(Calibration, RecoversTheLatenciesOfAKnownProfile) {
  // Samples made by a known profile over varied shapes: the fit must reproduce them.
  const HardwareProfile truth = toy_profile();
  const CostModel model(toy_model(), truth);
  std::vector<CalibrationSample> samples;
  for (std::int64_t n : {1, 8, 64, 512, 2048}) {
    const EntryShape prefill{n, 0, 0};
    samples.push_back({model.work(std::span(&prefill, 1)), 0});
  }
  for (std::int64_t batch : {1, 4, 16, 64})
    for (std::int64_t context : {16, 256, 4000}) {
      std::vector<EntryShape> decodes(static_cast<std::size_t>(batch), {1, context, 0});
      samples.push_back({model.work(decodes), 0});
    }
  for (auto& s : samples) s.measured_s = model.cost(s.work).total();
  HardwareProfile start = truth;
  start.efficiency = {0.9, 0.9, 0.9, 0.9, 0.9};
  start.step_overhead_s = 1e-4;
  start.sequence_overhead_s = 1e-6;
  const CalibrationFit fit = fit_hardware_profile(start, samples);
  EXPECT_LT(fit.mean_abs_rel_error, 0.01);
  EXPECT_LT(fit.max_abs_rel_error, 0.05);
  for (const auto& s : samples) EXPECT_LT(relative_error(fit.profile, s), 0.05);
  EXPECT_NEAR(fit.profile.step_overhead_s, truth.step_overhead_s, 0.1 * truth.step_overhead_s);
}

TEST(Calibration, KeepsTheStartPeakAsACeilingAndFoldsBandwidthAboveItsStart) {
  // The device computes at 0.5 TFLOP/s (toy: 1.0 x gemm 0.5) and reads at 50 GB/s, but the start
  // profile states 0.4 TFLOP/s and 25 GB/s. The FMA peak is a ceiling: the fit keeps it and every
  // compute efficiency within (0, 1]. A bandwidth is not (caches beat DRAM): the fit raises it.
  const HardwareProfile truth = toy_profile();
  const CostModel model(toy_model(), truth);
  std::vector<CalibrationSample> samples;
  for (std::int64_t n : {1, 8, 64, 512, 2048, 4000}) {
    const EntryShape prefill{n, 0, 0};
    samples.push_back({model.work(std::span(&prefill, 1)), 0});
  }
  for (std::int64_t batch : {1, 4, 16})
    for (std::int64_t context : {16, 4000}) {
      std::vector<EntryShape> decodes(static_cast<std::size_t>(batch), {1, context, 0});
      samples.push_back({model.work(decodes), 0});
    }
  for (auto& s : samples) s.measured_s = model.cost(s.work).total();
  HardwareProfile start = truth;
  start.peak_tflops = 0.4;
  start.memory_gb_per_s = 25.0;
  const CalibrationFit fit = fit_hardware_profile(start, samples);
  EXPECT_EQ(fit.profile.peak_tflops, start.peak_tflops);
  for (const double e :
       {fit.profile.efficiency.gemm_compute, fit.profile.efficiency.attention_compute})
    EXPECT_LE(e, 1.0);
  EXPECT_GT(fit.profile.memory_gb_per_s, start.memory_gb_per_s);
  EXPECT_LE(fit.profile.efficiency.gemm_memory, 1.0);
}

TEST(Calibration, FitsEachKernelRegimeOfTheStartProfile) {
  // A device whose products get 3x slower from 4 rows on and whose decode attention is slower
  // from 8 sequences: one efficiency for all could not fit both sides of either switch.
  HardwareProfile truth = toy_profile();
  truth.step_overhead_s = 1e-6;  // small: the toy's steps are made of work, not overhead
  truth.gemm_regimes = {{4, 0.15, 0.15}};
  truth.decode_attention_regimes = {{8, 0.2, 0.1}};
  const CostModel model(toy_model(), truth);
  std::vector<CalibrationSample> samples;
  for (std::int64_t n : {1, 2, 8, 64, 512, 2048}) {
    const EntryShape prefill{n, 0, 0};
    samples.push_back({model.work(std::span(&prefill, 1)), 0});
  }
  for (std::int64_t batch : {1, 2, 3, 4, 6, 8, 16, 64})
    for (std::int64_t context : {16, 1000, 4000}) {
      std::vector<EntryShape> decodes(static_cast<std::size_t>(batch), {1, context, 0});
      samples.push_back({model.work(decodes), 0});
    }
  for (auto& s : samples) s.measured_s = model.cost(s.work).total();
  HardwareProfile start = truth;
  start.efficiency = {0.9, 0.9, 0.9, 0.9, 0.9};
  start.gemm_regimes = {{4, 0.9, 0.9}};
  start.decode_attention_regimes = {{8, 0.9, 0.9}};
  const CalibrationFit fit = fit_hardware_profile(start, samples);
  EXPECT_LT(fit.mean_abs_rel_error, 0.01);
  EXPECT_LT(fit.max_abs_rel_error, 0.05);
  ASSERT_EQ(fit.profile.gemm_regimes.size(), 1u);
  EXPECT_EQ(fit.profile.gemm_regimes[0].min_rows, 4);
  ASSERT_EQ(fit.profile.decode_attention_regimes.size(), 1u);

  HardwareProfile without = start;  // the same samples with one efficiency for every size
  without.gemm_regimes.clear();
  without.decode_attention_regimes.clear();
  EXPECT_GT(fit_hardware_profile(without, samples).mean_abs_rel_error, 0.1);
}

// kvlab calibrate --backend cuda: steps with prefill tokens replay no CUDA graph and pay
// ungraphed_step_s more; a fit that gives them the term recovers it (10%), one that does not
// leaves the mixed steps off.
TEST(Calibration, FitsTheOverheadOfStepsThatReplayNoGraph) {
  HardwareProfile truth = toy_profile();
  truth.ungraphed_step_s = 2e-3;
  const CostModel model(toy_model(), truth);
  std::vector<CalibrationSample> samples;
  for (std::int64_t batch : {1, 3, 8, 20, 48})
    for (std::int64_t context : {16, 200}) {
      samples.push_back({model.work(std::vector<EntryShape>(batch, {1, context, 0})), 0});
      auto mixed = std::vector<EntryShape>(batch, {1, context, 0});
      mixed.push_back({batch * 4, 0, 0});
      samples.push_back({model.work(mixed), 0});
      samples.push_back({model.work(std::vector<EntryShape>{{batch * 8, context, 0}}), 0});
    }
  for (auto& s : samples) s.measured_s = step_cost(s.work, truth).total();
  HardwareProfile start = toy_profile();
  const CalibrationFit fit = fit_hardware_profile(start, samples, true);
  EXPECT_NEAR(fit.profile.ungraphed_step_s, 2e-3, 0.1 * 2e-3);
  EXPECT_LT(fit.mean_abs_rel_error, 0.01);
  const CalibrationFit without = fit_hardware_profile(start, samples);
  EXPECT_EQ(without.profile.ungraphed_step_s, 0);
  EXPECT_GT(without.mean_abs_rel_error, 2 * fit.mean_abs_rel_error);
}

// A start profile with kernel terms (kvlab calibrate --vidur's): the fit keeps its floors and
// knees and moves its element-wise kinds together, keeping their ratios.
TEST(Calibration, KeepsTheStartsKernelTermsAndScalesItsElementwiseKinds) {
  HardwareProfile truth = toy_profile();
  truth.gemm_kernel = {2e-6, 1.5};
  truth.decode_attention_kernel = {3e-6, 1.2};
  truth.elementwise[0] = {0.2, 1e-6};
  truth.elementwise[2] = {0.4, 2e-6};
  const CostModel model(toy_model(), truth);
  std::vector<CalibrationSample> samples;
  for (std::int64_t batch : {1, 4, 16, 64})
    for (std::int64_t context : {8, 100, 400}) {
      samples.push_back({model.work(std::vector<EntryShape>(batch, {1, context, 0})), 0});
      samples.push_back({model.work(std::vector<EntryShape>{{batch * 4, context, 0}}), 0});
    }
  for (auto& s : samples) s.measured_s = step_cost(s.work, truth).total();
  HardwareProfile start = truth;
  start.efficiency.elementwise_memory = 0.25;  // half the truth's 0.5: kinds start at half too
  start.elementwise[0].memory = 0.1;
  start.elementwise[2].memory = 0.2;
  const CalibrationFit fit = fit_hardware_profile(start, samples);
  EXPECT_LT(fit.mean_abs_rel_error, 0.01);
  EXPECT_EQ(fit.profile.gemm_kernel.floor_s, 2e-6);
  EXPECT_EQ(fit.profile.decode_attention_kernel.knee, 1.2);
  EXPECT_NE(fit.profile.elementwise[2].memory, 0.2);  // moved, with the other kind
  EXPECT_NEAR(fit.profile.elementwise[2].memory / fit.profile.elementwise[0].memory, 2.0, 1e-9);
}

TEST(Calibration, WeightsDecideBetweenSamplesThatDisagree) {
  // Two measurements of the same shape, 20% apart: the fit lands nearer the heavier one.
  const CostModel model(toy_model(), toy_profile());
  std::vector<CalibrationSample> samples;
  for (std::int64_t n : {1, 4, 16, 64, 256, 1024, 2048, 4000}) {
    const EntryShape prefill{n, 0, 0};
    const StepWork w = model.work(std::span(&prefill, 1));
    const double t = model.cost(w).total();
    samples.push_back({w, t, 9.0});
    samples.push_back({w, 1.2 * t, 1.0});
  }
  const CalibrationFit fit = fit_hardware_profile(toy_profile(), samples);
  for (std::size_t i = 0; i < samples.size(); i += 2)
    EXPECT_LT(relative_error(fit.profile, samples[i]), relative_error(fit.profile, samples[i + 1]));
  samples[3].weight = 0;
  test::expect_error_containing([&] { fit_hardware_profile(toy_profile(), samples); },
                                {"sample weight of 0"});
}

TEST(Calibration, RejectsTooFewSamplesAndBadLatencies) {
  const CostModel model(toy_model(), toy_profile());
  const EntryShape e{1, 4, 0};
  std::vector<CalibrationSample> few(3, {model.work(std::span(&e, 1)), 1e-3});
  test::expect_error_containing([&] { fit_hardware_profile(toy_profile(), few); },
                                {"at least 7 samples", "got 3"});
  std::vector<CalibrationSample> bad(8, {model.work(std::span(&e, 1)), 1e-3});
  bad[3].measured_s = 0;
  test::expect_error_containing([&] { fit_hardware_profile(toy_profile(), bad); },
                                {"measured latency of 0"});
}

TEST(SwapLink, FitRecoversLatencyAndBandwidth) {
  // Copies of a link with 3 us per copy and 12 GB/s: the fit gives both back.
  std::vector<LinkSample> samples;
  for (const double bytes : {1e4, 5e4, 2e5, 1e6, 4e6})
    for (const bool out : {true, false}) samples.push_back({1, bytes, 3e-6 + bytes / 12e9, out});
  const SwapLink link = fit_swap_link(samples);
  EXPECT_NEAR(link.gb_per_s, 12.0, 12.0 * 1e-9);
  EXPECT_NEAR(link.latency_s, 3e-6, 3e-6 * 1e-6);
  EXPECT_EQ(link.samples.size(), samples.size());
}

TEST(SwapLink, ANegativeLatencyFitsThroughTheOrigin) {
  // Small copies faster than the large ones' line (cache): no negative per-copy cost.
  const std::vector<LinkSample> samples{
      {1, 1e4, 0.5e-6, true}, {1, 1e5, 8e-6, true}, {1, 1e6, 90e-6, true}};
  const SwapLink link = fit_swap_link(samples);
  EXPECT_EQ(link.latency_s, 0.0);
  EXPECT_GT(link.gb_per_s, 10.0);  // 1e6 B in 90 us is 11.1 GB/s; the smaller copies pull up
  EXPECT_LT(link.gb_per_s, 20.0);
}

TEST(SwapLink, RefusesOneSizeAndSamplesThatAreNotPositive) {
  const std::vector<LinkSample> one_size{{1, 1e4, 1e-6, true}, {1, 1e4, 2e-6, false}};
  test::expect_error_containing([&] { fit_swap_link(one_size); }, {"1 copy size", "needs two"});
  const std::vector<LinkSample> zero{{1, 1e4, 0, true}, {4, 4e4, 2e-6, true}};
  test::expect_error_containing([&] { fit_swap_link(zero); }, {"in 0 s"});
  const std::vector<LinkSample> shrinking{{1, 1e4, 5e-6, true}, {4, 4e4, 1e-6, true}};
  test::expect_error_containing([&] { fit_swap_link(shrinking); }, {"did not take longer"});
}

TEST(SwapLink, TimesTheEnginesSwapCopyAndLeavesThePoolAsItWas) {
  // f16: the copy widens to the fp32 buffer and rounds back; values f16 holds exactly.
  KvPool pool({2, 2, 8, 128, DType::dtype_f16});
  for (std::int64_t l = 0; l < 2; ++l)
    for (std::int64_t s = 0; s < 128; ++s) {
      std::vector<float> row(16);
      for (std::size_t i = 0; i < row.size(); ++i)
        row[i] = static_cast<float>(l * 100 + s % 64) + 0.25f * static_cast<float>(i);  // exact
      pool.write_row(l, s, false, row.data());
      pool.write_row(l, s, true, row.data());
    }
  const SwapLink link = measure_swap_link(pool, 64, 3);
  ASSERT_EQ(link.samples.size(), 8u);       // 1, 4, 16, 64 tokens, out and in
  for (const LinkSample& s : link.samples)  // K and V, 2 layers, 16 values of 2 bytes a token
    EXPECT_EQ(s.bytes, static_cast<double>(2 * 2 * 16 * 2 * s.tokens));
  EXPECT_GT(link.gb_per_s, 0);
  EXPECT_GE(link.latency_s, 0);
  for (std::int64_t l = 0; l < 2; ++l)
    for (std::int64_t s = 0; s < 128; ++s) {
      std::vector<float> k(16), v(16);
      pool.read_row(l, s, false, k.data());
      pool.read_row(l, s, true, v.data());
      for (std::size_t i = 0; i < k.size(); ++i) {
        const float expected = static_cast<float>(l * 100 + s % 64) + 0.25f * static_cast<float>(i);
        ASSERT_EQ(k[i], expected) << l << " " << s;
        ASSERT_EQ(v[i], k[i]);
      }
    }
  KvPool bookkeeping({2, 2, 8, 128}, KvStorage::none);
  test::expect_error_containing([&] { measure_swap_link(bookkeeping, 64, 3); },
                                {"no K/V", "no storage, no device"});
}

TEST(SimulatedBackend, TokensAreDeterministicAndNeverEos) {
  SimulatedBackend backend(3, {0, 1});
  std::vector<std::int32_t> prompt{2, 2, 2};
  std::vector<BatchEntry> batch(5);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    batch[i].tokens = prompt;
    batch[i].start_position = static_cast<std::int64_t>(i);
  }
  const ForwardResult result = backend.forward(batch, {});
  EXPECT_TRUE(result.logits.empty());
  ASSERT_EQ(result.tokens.size(), batch.size());
  for (std::int32_t t : result.tokens) EXPECT_EQ(t, 2);  // the only non-EOS id

  SimulatedBackend wide(32000, {2});
  const std::int32_t a = wide.token_after(17, 100);
  EXPECT_EQ(a, wide.token_after(17, 100));
  EXPECT_NE(a, 2);
  std::set<std::int32_t> distinct;
  for (std::int64_t p = 0; p < 100; ++p) distinct.insert(wide.token_after(17, p));
  EXPECT_GT(distinct.size(), 90u);  // varied, not a constant
  test::expect_error_containing([] { SimulatedBackend(1, {0}); }, {"not EOS"});
}

// A verify entry's logit_rows get a token each: the token after each of its last positions, as
// a decode of that position alone would give, entry by entry.
TEST(SimulatedBackend, AnEntryGetsATokenForEachOfItsLogitRows) {
  SimulatedBackend backend(32000, {2});
  const std::vector<std::int32_t> verify_tokens{11, 12, 13, 14};
  const std::vector<std::int32_t> decode_tokens{99};
  std::vector<BatchEntry> batch(2);
  batch[0].tokens = verify_tokens;
  batch[0].start_position = 20;
  batch[0].logit_rows = 3;  // positions 21, 22, 23
  batch[1].tokens = decode_tokens;
  batch[1].start_position = 7;
  const ForwardResult result = backend.forward(batch, {});
  const std::vector<std::int32_t> got(result.tokens.begin(), result.tokens.end());
  EXPECT_EQ(got,
            (std::vector<std::int32_t>{backend.token_after(12, 21), backend.token_after(13, 22),
                                       backend.token_after(14, 23), backend.token_after(99, 7)}));
}

// kvlab cost's breakdown: over prefills, decodes, mixed steps, a verify's rows and tensor and
// context parallelism, the operators' runs x seconds add up to each StepCost group and to the
// step (relative 1e-9: the same terms summed in another order), and their FLOPs and bytes to
// StepWork's; a layer's four GEMMs, in this order, carry the linear group's FLOPs.
TEST(CostBreakdown, TheOperatorsAddUpToTheGroupsTheSimulatorCharges) {
  const std::vector<std::vector<EntryShape>> steps = {
      {{512, 0, 0, 1}},
      {{2048, 1024, 0, 1}},
      std::vector<EntryShape>(32, {1, 1024, 0, 1}),
      {{512, 0, 0, 1}, {1, 2047, 0, 1}, {1, 300, 0, 1}, {5, 700, 0, 5}},
  };
  const struct {
    const char* model;
    const char* gpu;
    std::int64_t tp, cp;
  } setups[] = {{"llama2-7b", "a100-80gb", 1, 1},   {"llama2-70b", "h100-sxm", 4, 1},
                {"llama2-7b", "h200", 2, 2},        {"tinyllama-1.1b", "l4", 1, 1},
                {"deepseek-v3", "h200", 8, 1},  // MLA with a compressed query, experts
                {"llama2-7b-mla", "h100-sxm", 1, 1}};
  for (const auto& setup : setups) {
    const CostModel model(model_preset(setup.model), load_hardware_profile(setup.gpu), setup.tp,
                          setup.cp);
    for (const auto& step : steps) {
      SCOPED_TRACE(fmt::format("{} on {} tp {} cp {}, {} entries", setup.model, setup.gpu, setup.tp,
                               setup.cp, step.size()));
      const StepBreakdown b = model.breakdown(step);
      std::map<std::string, double> seconds, flops, bytes;
      double total = 0;
      for (const OperatorCost& op : b.operators) {
        const double runs = static_cast<double>(op.runs);
        seconds[op.group] += op.seconds * runs;
        flops[op.group] += op.work.flops * runs;
        bytes[op.group] += op.work.bytes * runs;
        total += op.seconds * runs;
        EXPECT_GE(op.seconds, 0) << op.name;
      }
      const StepCost& c = b.cost;
      const auto near = [](double a, double b) { return std::abs(a - b) <= 1e-9 * std::abs(b); };
      EXPECT_PRED2(near, total, c.total());
      const std::pair<const char*, double> groups[] = {{"linear", c.linear_s},
                                                       {"lm_head", c.lm_head_s},
                                                       {"attention_prefill", c.attention_prefill_s},
                                                       {"attention_decode", c.attention_decode_s},
                                                       {"elementwise", c.elementwise_s},
                                                       {"overhead", c.overhead_s},
                                                       {"collectives", c.collectives_s},
                                                       {"ring", c.ring_s}};
      for (const auto& [group, expected] : groups)
        EXPECT_PRED2(near, seconds[group], expected) << group;
      const StepWork& w = b.work;
      EXPECT_PRED2(near, flops["linear"], w.linear.flops);
      EXPECT_PRED2(near, bytes["linear"], w.linear.bytes);
      EXPECT_PRED2(near, bytes["elementwise"], w.elementwise.bytes);
      EXPECT_PRED2(near, flops["attention_prefill"] + flops["attention_decode"],
                   w.attention_prefill.flops + w.attention_decode.flops);
      EXPECT_PRED2(near, bytes["collectives"], w.collective_bytes);
      ASSERT_GE(b.operators.size(), 4u);
      const bool mla = model.model().is_mla();
      EXPECT_EQ(b.operators[0].name, !mla                        ? "qkv_proj"
                                     : model.model().q_lora_rank ? "q_a_proj"
                                                                 : "q_proj");
      const std::size_t linear_ops =
          std::count_if(b.operators.begin(), b.operators.end(),
                        [](const OperatorCost& op) { return op.group == "linear"; });
      EXPECT_EQ(b.operators[linear_ops - 1].name, "down_proj");
      EXPECT_TRUE(b.operators[0].per_layer);
      EXPECT_EQ(b.operators[0].runs, model.model().num_hidden_layers);
    }
  }
}

// Latent attention on a simulated GPU: a decode reads the latent (kv_lora_rank + rope values a
// token a layer, replicated on every GPU of a tensor-parallel group) and, absorbed, every head
// works over it: 2 x heads x (latent + kv_lora_rank) FLOPs a key, 4.25x a 128-dim MHA head's.
// A prefill over cached keys rebuilds their K and V (kv_b_proj over their latents). Routed experts:
// a one-token step reads the weights of the experts it routes to, not all of them.
TEST(CostModel, LatentAttentionReadsTheLatentAndPaysTheAbsorbedFlops) {
  const ModelConfig v3 = model_preset("deepseek-v3");
  const CostModel model(v3, load_hardware_profile("h200"), 8);
  const double kv_element = static_cast<double>(dtype_size(model.profile().kv_dtype));
  EXPECT_EQ(model.kv_bytes_per_token_per_gpu(),
            static_cast<std::int64_t>(61 * (512 + 64) * kv_element))
      << "every GPU holds the whole latent";
  const EntryShape decode{1, 4095, 0, 1};  // 4,096 keys
  const StepWork w = model.work(std::span(&decode, 1));
  EXPECT_DOUBLE_EQ(w.attention_decode.flops, 61.0 * 2 * (128.0 / 8) * (576 + 512) * 4096);
  const double act = static_cast<double>(dtype_size(model.profile().compute_dtype));
  EXPECT_NEAR(w.attention_decode.bytes,
              61.0 * (4096 * 576 * kv_element + 2 * (128.0 / 8) * 192 * act), 1.0);
  const CostModel plain(model_preset("llama2-7b"), load_hardware_profile("h200"));
  const CostModel latent(model_preset("llama2-7b-mla"), load_hardware_profile("h200"));
  const StepWork mha_step = plain.work(std::span(&decode, 1));
  const StepWork mla_step = latent.work(std::span(&decode, 1));
  EXPECT_DOUBLE_EQ(mla_step.attention_decode.flops / mha_step.attention_decode.flops,
                   (576.0 + 512) / (2 * 128));
  EXPECT_NEAR(mha_step.attention_decode.bytes / mla_step.attention_decode.bytes,
              2 * 32 * 128 / 576.0, 0.1);
  // A 1,024-token prefill after 3,072 cached tokens: kv_b_proj over 4,096 latents, not 1,024.
  const EntryShape fresh{1024, 0, 0, 1}, after{1024, 3072, 0, 1};
  const double kv_b = 512.0 * 32 * (128 + 128);
  EXPECT_NEAR(latent.work(std::span(&after, 1)).linear.flops -
                  latent.work(std::span(&fresh, 1)).linear.flops,
              32 * 2 * 3072 * kv_b, 1e3);
  // Experts: a decode of one token reads 8 + 1 of 257 experts in 58 of 61 layers; 256 tokens
  // read nearly all of them.
  const double one = w.linear.bytes;
  std::vector<EntryShape> many(256, decode);
  const double batch = model.work(many).linear.bytes;
  EXPECT_GT(batch / one, 10.0);
  EXPECT_LT(one, model.weight_bytes() / 5);
}

// kvlab cost's --step: prefills (K sequences, cached tokens), decodes and mixed steps; every
// other text is refused with the part named.
TEST(StepSpec, ReadsPrefillsDecodesAndMixedStepsAndRefusesTheRest) {
  const auto step = parse_step_spec("prefill=2x512@1024,decode=3x100");
  ASSERT_EQ(step.size(), 5u);
  EXPECT_EQ(step[0].new_tokens, 512);
  EXPECT_EQ(step[1].start_position, 1024);
  EXPECT_EQ(step[2].new_tokens, 1);
  EXPECT_EQ(step[4].start_position, 100);
  EXPECT_EQ(parse_step_spec("prefill=7").front().start_position, 0);
  const auto error = [](const char* text) {
    return test::error_of<Error>([&] { (void)parse_step_spec(text); });
  };
  EXPECT_NE(error("prefil=5").find("neither prefill"), std::string::npos);
  EXPECT_NE(error("decode=axb").find("\"a\" is not a count"), std::string::npos);
  EXPECT_NE(error("decode=16").find("a decode is BxL"), std::string::npos);
  EXPECT_NE(error("decode=2x4@3").find("its L in BxL"), std::string::npos);
  EXPECT_NE(error("prefill=0").find("no tokens"), std::string::npos);
  EXPECT_NE(error("decode=70000x1").find("more than 65536"), std::string::npos);
  EXPECT_NE(error("decode=40000x1,decode=40000x1").find("more than 65536 sequences"),
            std::string::npos);
  EXPECT_NE(error("prefill=99999999999999999999").find("not a count"), std::string::npos);
  EXPECT_NE(error("").find("empty"), std::string::npos);
  EXPECT_NE(error(",").find("neither prefill"), std::string::npos);
}

}  // namespace
}  // namespace kvlab
