// The cuda backend plugin end to end: for every allocator and attention variant, the engine on
// the GPU (fp32) produces the greedy tokens of the CPU backend, with preemptions (recompute and
// swap through the device pool) and the dynamic allocator's moves (copies on the device); one
// mixed step's logits agree with the CPU backend's within 1e-3 (fp32; logits are O(1-10)) and,
// in bf16, within 0.25 (about 2% of the logit range). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "cpu_reference/test_models.hpp"
#include "cuda_test_util.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/engine/engine.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/workload/workload.hpp"
#include "plugin_registry.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const cpu::LlamaWeights& checkpoint() {
  static const cpu::LlamaWeights w = test::scaled_random_weights(model_preset("tiny"), 99);
  return w;
}
// What a backend plugin is given (PluginContext::weights).
const ModelWeightsView& checkpoint_view() {
  static const ModelWeightsView view = cpu::weights_view(checkpoint());
  return view;
}
// The `cuda` backend comes from the GPU build's plugin directory, or, in the emulated test
// binary, from the directory of the same plugin built on the CPU emulator.
#ifndef KVLAB_CUDA_BACKEND_PLUGIN_DIR
#define KVLAB_CUDA_BACKEND_PLUGIN_DIR KVLAB_PLUGIN_DIR
#endif
const PluginRegistry& backend_registry() {
  static const PluginRegistry r({KVLAB_CUDA_BACKEND_PLUGIN_DIR});
  return r;
}
using Params = std::map<std::string, ParamValue, std::less<>>;

// The cuda backend on the checkpoint, holding its K/V in `pool` (dtype "f32" or "bf16").
PluginObject<Backend> create_cuda_backend(KvPool& pool, const std::string& dtype) {
  PluginContext context;
  context.model = &checkpoint().config;
  context.pool = &pool;
  context.weights = &checkpoint_view();
  return backend_registry().create<PluginKind::backend>("cuda", {{"dtype", dtype}}, context);
}

struct EngineRun {
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<std::vector<GeneratedLogprobs>> logprobs;
  std::int64_t preemptions = 0;
  BackendCounters counters;
  std::int64_t proposed = 0, accepted = 0;  // speculative decoding's totals
};

// How run_engine runs, beyond the strategies: the backend's params, the scheduler, the clock.
struct RunOptions {
  Params backend_params;
  std::string scheduler = "fcfs";
  Params scheduler_params;
  EngineClock clock = EngineClock::steps;  // tokens are compared, not times
  DType kv_dtype = DType::dtype_f32;       // the pool's (cuda: f32, fp8 or int8)
  SpeculationOptions speculation;          // off (tokens 0)
};
RunOptions with_backend_params(Params params) {
  RunOptions options;
  options.backend_params = std::move(params);
  return options;
}

EngineRun run_engine(bool on_gpu, const std::string& allocator, const Params& allocator_params,
                     const std::string& attention, const Params& attention_params,
                     const std::string& preemption, std::int64_t slots,
                     const std::vector<WorkloadRequest>& requests, const RunOptions& setup = {}) {
  PluginContext context;
  context.model = &checkpoint().config;
  context.max_seq_len = 64;
  auto variant = test::plugin_registry().create<PluginKind::attention_variant>(
      attention, attention_params, context);
  const cpu::LlamaWeights weights =
      cpu::convert_kv_heads(checkpoint(), variant->kv_heads(checkpoint().config));
  const ModelConfig& c = weights.config;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, slots, setup.kv_dtype},
              on_gpu ? KvStorage::none : KvStorage::host);
  const ModelWeightsView view = cpu::weights_view(weights);
  context.pool = &pool;
  context.model = &c;
  context.weights = &view;
  context.window = variant->window().value_or(0);
  auto kv = test::plugin_registry().create<PluginKind::kv_allocator>(allocator, allocator_params,
                                                                     context);
  Params scheduler_params = setup.scheduler_params;
  if (setup.scheduler == "fcfs") scheduler_params.emplace("preemption", preemption);
  auto scheduler = test::plugin_registry().create<PluginKind::scheduler>(setup.scheduler,
                                                                         scheduler_params, context);
  std::unique_ptr<cpu::CpuBackend> cpu_backend;
  PluginObject<Backend> gpu_backend;
  if (on_gpu)
    gpu_backend =
        backend_registry().create<PluginKind::backend>("cuda", setup.backend_params, context);
  else
    cpu_backend = std::make_unique<cpu::CpuBackend>(weights, pool, variant->window());
  EngineOptions options;
  options.clock = setup.clock;
  options.rules = sequence_rules(c, *variant);
  options.rules.context = 64;
  options.pool = &pool;
  options.swap_slots = 4096;
  options.speculation = setup.speculation;
  Engine engine(on_gpu ? *gpu_backend : static_cast<Backend&>(*cpu_backend), *kv, *scheduler,
                options);
  const EngineResult result = engine.run(requests);
  EngineRun run;
  run.tokens = result.tokens;
  run.logprobs = result.logprobs;
  if (on_gpu) run.counters = gpu_backend->counters();
  for (const VerifyRecord& v : result.verifies) {
    run.proposed += v.proposed;
    run.accepted += v.accepted;
  }
  for (const auto& r : result.requests) {
    EXPECT_FALSE(r.rejected) << r.reject_reason;
    run.preemptions += r.preemptions;
  }
  return run;
}

// `requests` of 3-24 prompt tokens and `min_output`-`max_output` answer tokens, Poisson arrivals.
std::vector<WorkloadRequest> workload(std::int64_t requests = 10, std::int64_t min_output = 2,
                                      std::int64_t max_output = 10) {
  SyntheticWorkload spec;
  spec.requests = requests;
  spec.seed = 5;
  spec.vocab_size = checkpoint().config.vocab_size;
  spec.arrival = {ArrivalKind::poisson, 400.0, 1.0, 1};
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, 3, 24};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, min_output, max_output};
  return generate_workload(spec);
}

using Combo = std::tuple<std::string, std::string, std::string>;  // allocator, variant, preemption
class CudaEngine : public ::testing::TestWithParam<Combo> {};

TEST_P(CudaEngine, GreedyTokensEqualTheCpuBackend) {
  KVLAB_REQUIRE_CUDA();
  const auto& [allocator, variant, preemption] = GetParam();
  const Params allocator_params =
      allocator == "paged" ? Params{{"block_size", std::int64_t{4}}} : Params{};
  const Params variant_params =
      variant == "sliding_window" ? Params{{"window", std::int64_t{6}}} : Params{};
  const std::int64_t slots = allocator == "static" ? 64 * 3 : 72;  // tight: preemptions happen
  const auto requests = workload();
  const EngineRun cpu = run_engine(false, allocator, allocator_params, variant, variant_params,
                                   preemption, slots, requests);
  const EngineRun gpu = run_engine(true, allocator, allocator_params, variant, variant_params,
                                   preemption, slots, requests);
  ASSERT_EQ(gpu.tokens.size(), cpu.tokens.size());
  for (std::size_t i = 0; i < cpu.tokens.size(); ++i)
    EXPECT_EQ(gpu.tokens[i], cpu.tokens[i]) << "request " << i;
  EXPECT_EQ(gpu.preemptions, cpu.preemptions);
  RecordProperty("preemptions", std::to_string(gpu.preemptions));
}

INSTANTIATE_TEST_SUITE_P(AllocatorsVariants, CudaEngine,
                         ::testing::Combine(::testing::Values("static", "dynamic", "paged"),
                                            ::testing::Values("mha", "gqa", "mqa", "sliding_window",
                                                              "recompute"),
                                            ::testing::Values("recompute", "swap")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param) + "_" +
                                  std::get<2>(info.param);
                         });

// A static batch on the measured clock computes its finished rows as padding: a pad token one
// position further each step, attending to as many keys and writing none, its view reaching past
// what the request holds by runs of pool slots (Engine::padding_entry), which the device's block
// table takes at the view's own block size (1 extent: static; blocks of 4: paged). The requests'
// tokens are the CPU backend's on the steps clock, which computes no padding rows.
TEST(CudaBackend, StaticBatchPaddingRowsLeaveTheTokens) {
  KVLAB_REQUIRE_CUDA();
  const auto requests = workload();
  RunOptions unpadded;
  unpadded.scheduler = "static";
  unpadded.scheduler_params = {{"max_batch", std::int64_t{4}}};
  RunOptions padded = unpadded;
  padded.clock = EngineClock::measured;
  const std::pair<std::string, Params> allocators[] = {
      {"static", {}}, {"paged", {{"block_size", std::int64_t{4}}}}};
  for (const auto& [allocator, params] : allocators) {
    const EngineRun cpu =
        run_engine(false, allocator, params, "gqa", {}, "recompute", 512, requests, unpadded);
    const EngineRun gpu =
        run_engine(true, allocator, params, "gqa", {}, "recompute", 512, requests, padded);
    EXPECT_EQ(gpu.tokens, cpu.tokens) << allocator;
  }
}

// With fp8 and int8 KV the engine on the device gives the tokens of the cpu backend over a pool of
// the same dtype, greedy, through swap preemptions (the quantized rows swapped out and back as
// they are) and a paged allocator; and other tokens than over an fp32 pool somewhere, so the
// pools do round.
TEST(CudaBackend, QuantizedKvEngineGivesTheCpuTokensThroughSwaps) {
  KVLAB_REQUIRE_CUDA();
  const std::vector<WorkloadRequest> requests = workload();
  const Params paged{{"block_size", std::int64_t{4}}};
  const EngineRun exact = run_engine(false, "paged", paged, "gqa", {}, "swap", 72, requests);
  for (DType kv_dtype : {DType::dtype_f8_e4m3, DType::dtype_kv_int8}) {
    RunOptions options;
    options.kv_dtype = kv_dtype;
    const EngineRun cpu =
        run_engine(false, "paged", paged, "gqa", {}, "swap", 72, requests, options);
    const EngineRun gpu =
        run_engine(true, "paged", paged, "gqa", {}, "swap", 72, requests, options);
    EXPECT_GT(gpu.preemptions, 0) << dtype_short_name(kv_dtype)
                                  << ": the pool is too small for all";
    EXPECT_EQ(gpu.preemptions, cpu.preemptions) << dtype_short_name(kv_dtype);
    EXPECT_EQ(gpu.tokens, cpu.tokens) << dtype_short_name(kv_dtype);
    if (kv_dtype == DType::dtype_f8_e4m3) {
      EXPECT_NE(cpu.tokens, exact.tokens) << "fp8 rounding changes some greedy token";
    }
  }
}

// Sampled requests (temperature, top-k, top-p, each with its seed) get the CPU backend's tokens
// although the cuda backend picks them on the device (Backend::forward given token choices) and the
// CPU backend's engine picks them on the host: the draws are the requests' own either way.
TEST(CudaBackend, SampledTokensEqualTheCpuBackend) {
  KVLAB_REQUIRE_CUDA();
  std::vector<WorkloadRequest> requests = workload();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    SamplingParams& p = requests[i].sampling;
    p.temperature = i % 3 == 0 ? 0.0 : 0.6 + 0.2 * static_cast<double>(i % 4);
    p.top_k = i % 2 == 0 ? 40 : 0;
    p.top_p = i % 4 == 1 ? 0.9 : 1.0;
    p.seed = 100 + i;
  }
  const Params paged{{"block_size", std::int64_t{4}}};
  const EngineRun cpu = run_engine(false, "paged", paged, "gqa", {}, "swap", 72, requests);
  const EngineRun gpu = run_engine(true, "paged", paged, "gqa", {}, "swap", 72, requests);
  ASSERT_EQ(gpu.tokens.size(), cpu.tokens.size());
  for (std::size_t i = 0; i < cpu.tokens.size(); ++i)
    EXPECT_EQ(gpu.tokens[i], cpu.tokens[i]) << "request " << i;
  // The draws matter: greedy decoding of the same requests gives other tokens.
  std::vector<WorkloadRequest> greedy = requests;
  for (auto& r : greedy) r.sampling.temperature = 0;
  EXPECT_NE(run_engine(false, "paged", paged, "gqa", {}, "swap", 72, greedy).tokens, cpu.tokens);
}

// Two waves (steps clock): 5 short prompts at step 0 with long outputs, then at step 8 five
// longer prompts, whose prefill makes the step-metadata buffers move; then decode steps of 10, 9,
// .. 1 sequences as requests finish.
std::vector<WorkloadRequest> two_waves() {
  std::vector<WorkloadRequest> requests;
  const auto vocab = static_cast<std::int32_t>(checkpoint().config.vocab_size);
  for (std::int64_t i = 0; i < 10; ++i) {
    const bool late = i >= 5;
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = late ? 8.0 : 0.0;
    const std::int64_t prompt = late ? 20 + i % 5 : 4 + i;
    for (std::int64_t k = 0; k < prompt; ++k)
      r.prompt.push_back(static_cast<std::int32_t>((i * 131 + k * 7 + 3) % vocab));
    r.output_tokens = late ? 10 + 2 * (i % 5) : 20 + 2 * i;
    r.sampling.ignore_eos = true;
    // Odd requests draw between their two likeliest tokens: the draw decides half the tokens,
    // yet a token flips only if a draw lands within float noise of the single boundary between
    // them. Over the whole vocabulary (512 boundaries here) the CPU backend's and the device's
    // last-bit differences in the logits flipped a token of the portable build.
    r.sampling.temperature = i % 2 == 0 ? 0.0 : 1.0;
    r.sampling.top_k = 2;
    r.sampling.seed = 7 + static_cast<std::uint64_t>(i);
    requests.push_back(std::move(r));
  }
  return requests;
}

// Decode steps whose tokens the device picks replay CUDA graphs captured per (batch bucket,
// split bucket): padded to 8 or 16 rows whose K/V go to the spare slot (not to a slot a
// sequence holds), a decode grid of a power of two splits of 16 keys (contexts up to 44 need 1
// to 3), and graphs dropped when a buffer they read moves (the second wave's prefill) and
// captured again. Greedy and sampled requests get the tokens of direct launches and of the CPU
// backend, and graphs were replayed.
TEST(CudaBackend, GraphedDecodeStepsGiveTheTokensOfDirectLaunches) {
  KVLAB_REQUIRE_CUDA();
  const std::vector<WorkloadRequest> requests = two_waves();
  const Params paged{{"block_size", std::int64_t{4}}};
  const Params graphed_params{{"split_keys", std::int64_t{16}}};
  const Params direct_params{{"split_keys", std::int64_t{16}}, {"cuda_graphs", false}};
  const EngineRun cpu = run_engine(false, "paged", paged, "gqa", {}, "swap", 512, requests);
  const EngineRun graphed = run_engine(true, "paged", paged, "gqa", {}, "swap", 512, requests,
                                       with_backend_params(graphed_params));
  const EngineRun direct = run_engine(true, "paged", paged, "gqa", {}, "swap", 512, requests,
                                      with_backend_params(direct_params));
  EXPECT_EQ(graphed.tokens, cpu.tokens);
  EXPECT_EQ(direct.tokens, cpu.tokens);
  EXPECT_GE(graphed.counters.graph_captures, 4);  // (8 and 16 rows) x (1, 2, 4 splits), again
  EXPECT_GT(graphed.counters.graph_replays, 20);
  EXPECT_EQ(direct.counters.graph_replays, 0);
  EXPECT_EQ(direct.counters.graph_captures, 0);
}

// Requests that ask for log-probabilities get them from the device with the tokens it picked (a
// kernel after the step's graph or launches; (1 + k) pairs per sequence cross, not its logits):
// within 1e-4 of the CPU backend's host values (f32; its logits agree to ~1e-5), and the same
// top tokens except where the host's own ranks are within that of each other.
TEST(CudaBackend, DeviceLogprobsEqualTheHostsFromTheCpuBackend) {
  KVLAB_REQUIRE_CUDA();
  std::vector<WorkloadRequest> requests = two_waves();
  for (std::size_t i = 0; i < requests.size(); ++i)
    requests[i].sampling.logprobs = i % 3 == 2 ? -1 : static_cast<std::int32_t>(i % 6);
  const Params paged{{"block_size", std::int64_t{4}}};
  const Params split{{"split_keys", std::int64_t{16}}};
  const EngineRun cpu = run_engine(false, "paged", paged, "gqa", {}, "swap", 512, requests);
  const EngineRun gpu = run_engine(true, "paged", paged, "gqa", {}, "swap", 512, requests,
                                   with_backend_params(split));
  ASSERT_EQ(gpu.tokens, cpu.tokens);
  EXPECT_GT(gpu.counters.graph_replays, 20);  // the graphed decode steps computed them too
  std::size_t tops = 0, asked = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    asked +=
        cpu.tokens[i].size() * static_cast<std::size_t>(std::max(requests[i].sampling.logprobs, 0));
    ASSERT_EQ(gpu.logprobs[i].size(), cpu.logprobs[i].size()) << i;
    EXPECT_EQ(gpu.logprobs[i].empty(), requests[i].sampling.logprobs < 0) << i;
    for (std::size_t t = 0; t < cpu.logprobs[i].size(); ++t) {
      const GeneratedLogprobs &device = gpu.logprobs[i][t], &host = cpu.logprobs[i][t];
      EXPECT_NEAR(device.logprob, host.logprob, 1e-4) << "request " << i << " token " << t;
      ASSERT_EQ(device.top.size(), host.top.size());
      for (std::size_t k = 0; k < host.top.size(); ++k, ++tops) {
        EXPECT_NEAR(device.top[k].logprob, host.top[k].logprob, 1e-4);
        const bool near_tie =
            (k > 0 && host.top[k - 1].logprob - host.top[k].logprob < 1e-4) ||
            (k + 1 < host.top.size() && host.top[k].logprob - host.top[k + 1].logprob < 1e-4);
        if (!near_tie) {
          EXPECT_EQ(device.top[k].token, host.top[k].token) << i << " " << t;
        }
      }
    }
  }
  EXPECT_EQ(tops, asked);
  EXPECT_GT(tops, 200u);
}

// Step 1: two prompts (13 and 30 tokens) at slots [0, 13) and [100, 130); step 2: one decode of
// each plus a third prompt of 5 tokens.
struct MixedSteps {
  std::vector<std::int32_t> a, b, d, next_a{7}, next_b{9};
  MixedSteps() : a(13), b(30), d(5) {
    const std::int64_t vocab = checkpoint().config.vocab_size;
    for (std::size_t i = 0; i < a.size(); ++i)
      a[i] = static_cast<std::int32_t>((i * 37 + 1) % vocab);
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<std::int32_t>((i * 11 + 5) % vocab);
    for (std::size_t i = 0; i < d.size(); ++i)
      d[i] = static_cast<std::int32_t>((i * 3 + 2) % vocab);
  }
  std::vector<BatchEntry> batch(int step) const {
    auto entry = [](std::span<const std::int32_t> tokens, std::int64_t start,
                    std::vector<KvExtent> extents) {
      BatchEntry e;
      e.tokens = tokens;
      e.start_position = start;
      e.view.extents = std::move(extents);
      return e;
    };
    if (step == 0) return {entry(a, 0, {{0, 13}}), entry(b, 0, {{100, 30}})};
    return {entry(next_a, 13, {{0, 14}}), entry(next_b, 30, {{100, 30}, {200, 1}}),
            entry(d, 0, {{50, 5}})};
  }
};

// The largest logit difference of each mixed step between two backends.
std::vector<double> mixed_step_differences(Backend& got, Backend& want) {
  const MixedSteps steps;
  std::vector<double> differences;
  for (int step = 0; step < 2; ++step) {
    const std::vector<BatchEntry> batch = steps.batch(step);
    const auto w = want.forward(batch, {}).logits;
    const std::vector<float> expected(w.begin(), w.end());
    const auto cmp = test::compare(got.forward(batch, {}).logits, expected);
    EXPECT_FALSE(cmp.has_nan) << "step " << step;
    differences.push_back(cmp.has_nan ? INFINITY : cmp.max_abs);
  }
  return differences;
}

TEST(CudaBackend, MixedStepLogitsMatchTheCpuBackendInBothDtypes) {
  KVLAB_REQUIRE_CUDA();
  const ModelConfig& c = checkpoint().config;
  for (const char* dtype : {"f32", "bf16"}) {
    KvPool host_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256});
    KvPool device_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256},
                       KvStorage::none);
    auto gpu = create_cuda_backend(device_pool, dtype);
    cpu::CpuBackend cpu(checkpoint(), host_pool, std::nullopt);
    const std::vector<double> differences = mixed_step_differences(*gpu, cpu);
    for (std::size_t step = 0; step < differences.size(); ++step)
      EXPECT_LT(differences[step], std::string(dtype) == "f32" ? 1e-3 : 0.25)
          << dtype << " step " << step;
  }
}

// fp8 (e4m3) and int8 KV on the device (fp32 compute): each K and V row rounded on write as the
// host pool rounds it, so the logits are the cpu backend's with the same kv dtype, within 1e-3 as
// in fp32 (the device's RoPE may differ from the host's in an fp32 ulp, which can move a value to
// the neighbouring code; the test's prompts show how far that goes). The quantization itself moves
// them further from the fp32 pool's, which the check must see (> 1e-3).
TEST(CudaBackend, QuantizedKvLogitsMatchTheCpuBackendWithTheSameKvDtype) {
  KVLAB_REQUIRE_CUDA();
  const ModelConfig& c = checkpoint().config;
  for (DType kv_dtype : {DType::dtype_f8_e4m3, DType::dtype_kv_int8}) {
    const KvPoolShape shape{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256, kv_dtype};
    KvPool host_pool(shape),
        f32_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256}),
        device_pool(shape, KvStorage::none);
    auto gpu = create_cuda_backend(device_pool, "f32");
    cpu::CpuBackend cpu(checkpoint(), host_pool, std::nullopt);
    const std::vector<double> same = mixed_step_differences(*gpu, cpu);
    auto gpu_again = create_cuda_backend(device_pool, "f32");
    cpu::CpuBackend cpu_f32(checkpoint(), f32_pool, std::nullopt);
    const std::vector<double> versus_f32 = mixed_step_differences(*gpu_again, cpu_f32);
    for (std::size_t step = 0; step < same.size(); ++step) {
      std::printf("%s step %zu: %.3g vs the same dtype, %.3g vs f32 KV\n",
                  std::string(dtype_short_name(kv_dtype)).c_str(), step, same[step],
                  versus_f32[step]);
      EXPECT_LT(same[step], 1e-3) << dtype_short_name(kv_dtype) << " step " << step;
      EXPECT_GT(versus_f32[step], 1e-3) << dtype_short_name(kv_dtype) << " step " << step;
    }
  }
}

std::vector<std::int32_t> prompt_13() {
  std::vector<std::int32_t> prompt(13);
  for (std::size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<std::int32_t>((i * 29 + 3) % checkpoint().config.vocab_size);
  return prompt;
}

// One sequence's prompt forwarded with its K/V in slots [0, size); the batch, for the next step.
std::vector<BatchEntry> prefill(Backend& backend, std::span<const std::int32_t> prompt) {
  std::vector<BatchEntry> batch(1);
  batch[0].tokens = prompt;
  batch[0].view.extents = {{0, static_cast<std::int64_t>(prompt.size())}};
  (void)backend.forward(batch, {});
  return batch;
}

// The device pool's side of swaps and allocator copies, directly: K/V written by a prompt,
// downloaded, uploaded into other slots (a swap) or copied there (a dynamic move), must read
// back bit for bit and give the decode step the same logits as the original slots; in both
// compute dtypes, and with fp8 and int8 pools, whose rows travel as the host pool's own bytes.
TEST(CudaBackend, SwapsAndSlotCopiesMoveKvExactly) {
  KVLAB_REQUIRE_CUDA();
  const ModelConfig& c = checkpoint().config;
  const std::pair<const char*, DType> settings[] = {{"f32", DType::dtype_f32},
                                                    {"bf16", DType::dtype_f32},
                                                    {"f32", DType::dtype_f8_e4m3},
                                                    {"bf16", DType::dtype_kv_int8}};
  for (const auto& [dtype, kv_dtype] : settings) {
    const std::string what = std::string(dtype) + " KV " + std::string(dtype_short_name(kv_dtype));
    KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 128, kv_dtype},
                KvStorage::none);
    auto gpu = create_cuda_backend(pool, dtype);
    ASSERT_NE(pool.device(), nullptr) << "the backend attaches its device pool";
    const std::int64_t row_bytes = pool.device()->host_row_bytes();
    EXPECT_EQ(row_bytes,
              kv_dtype == DType::dtype_f32 ? c.kv_dim() * 4 : pool.shape().slot_row_bytes(false))
        << what;
    const std::vector<std::int32_t> prompt = prompt_13(), next{5};
    std::vector<BatchEntry> batch = prefill(*gpu, prompt);

    // Decode the next token reading the 13 positions from `first_slot` on.
    const auto decode_from = [&](std::int64_t first_slot) {
      batch[0].tokens = next;
      batch[0].start_position = 13;
      batch[0].view.extents = {{first_slot, 13}, {first_slot + 13, 1}};
      const auto logits = gpu->forward(batch, {}).logits;
      return std::vector<float>(logits.begin(), logits.end());
    };
    const std::vector<float> reference = decode_from(0);

    std::vector<std::int64_t> original(13), swapped(13);
    std::iota(original.begin(), original.end(), 0);
    std::iota(swapped.begin(), swapped.end(), 40);
    const auto bytes = static_cast<std::size_t>(c.num_hidden_layers * 2 * 13 * row_bytes);
    std::vector<std::byte> out(bytes), back(bytes);
    pool.device()->download(original, out.data());
    pool.device()->upload(swapped, out.data());
    pool.device()->download(swapped, back.data());
    EXPECT_EQ(back, out) << what << ": a swap-in reads back what was swapped out";
    EXPECT_NE(std::count(out.begin(), out.end(), std::byte{0}), static_cast<std::ptrdiff_t>(bytes))
        << what << ": the prompt's K/V were written";
    const auto after_swap = test::compare(decode_from(40), reference);
    EXPECT_FALSE(after_swap.has_nan);
    EXPECT_EQ(after_swap.max_abs, 0.0) << what << ": the same K/V and arithmetic, other slots";

    pool.device()->copy_slots(0, 80, 13);
    const auto after_copy = test::compare(decode_from(80), reference);
    EXPECT_EQ(after_copy.max_abs, 0.0) << what << ": copied slots";
  }
}

// An entry that re-decodes a cached position without writing K/V (BatchEntry::writes_kv: a
// static batch's padding rows) leaves the device slot bit for bit as it was; the same entry that
// writes changes it (another token's K/V), so the check can fail.
TEST(CudaBackend, EntriesThatDoNotWriteKvLeaveTheirSlots) {
  KVLAB_REQUIRE_CUDA();
  const ModelConfig& c = checkpoint().config;
  for (const char* dtype : {"f32", "bf16"}) {
    KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32}, KvStorage::none);
    auto gpu = create_cuda_backend(pool, dtype);
    const std::vector<std::int32_t> prompt = prompt_13(), other{100};
    std::vector<BatchEntry> batch = prefill(*gpu, prompt);
    const auto floats = static_cast<std::size_t>(c.num_hidden_layers * 2 * c.kv_dim());
    const auto slot_12 = [&] {
      std::vector<float> kv(floats);
      pool.device()->download({12}, reinterpret_cast<std::byte*>(kv.data()));
      return kv;
    };
    const std::vector<float> cached = slot_12();

    batch[0].tokens = other;  // position 12 again, another token than the one cached there
    batch[0].start_position = 12;
    batch[0].writes_kv = false;
    for (const float logit : gpu->forward(batch, {}).logits)
      ASSERT_TRUE(std::isfinite(logit)) << dtype;
    EXPECT_EQ(slot_12(), cached) << dtype;
    batch[0].writes_kv = true;
    (void)gpu->forward(batch, {});
    EXPECT_NE(slot_12(), cached) << dtype << ": a writing entry stores its token's K/V";
  }
}

// A speculative verify's rows of logits (BatchEntry::logit_rows > 1): a verify entry of 4 tokens
// (logits at all 4) beside a decode of 1 and a prompt of 5 (its last token's): 6 rows, the
// verify's in position order, each the cpu backend's within 1e-3 (fp32, as the mixed steps
// above); given choices (one per row, greedy), each row's token is the cpu row's argmax. An entry
// asking for more rows than it has tokens is refused before any work.
TEST(CudaBackend, AVerifyEntryGetsTheCpuBackendsLogitsAtEachRow) {
  KVLAB_REQUIRE_CUDA();
  const ModelConfig& c = checkpoint().config;
  KvPool host_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256});
  KvPool device_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256},
                     KvStorage::none);
  auto gpu = create_cuda_backend(device_pool, "f32");
  cpu::CpuBackend cpu(checkpoint(), host_pool, std::nullopt);
  const MixedSteps steps;
  for (Backend* backend : {static_cast<Backend*>(gpu.get()), static_cast<Backend*>(&cpu)})
    (void)backend->forward(steps.batch(0), {});  // the two prompts cached
  const std::vector<std::int32_t> verified{7, 300, 41, 2};
  std::vector<BatchEntry> batch = steps.batch(1);
  batch[0].tokens = verified;
  batch[0].view.extents = {{0, 17}};
  batch[0].logit_rows = 4;
  const auto w = cpu.forward(batch, {}).logits;
  const std::vector<float> expected(w.begin(), w.end());
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  ASSERT_EQ(expected.size(), 6 * vocab);
  const auto got = gpu->forward(batch, {}).logits;
  const auto cmp = test::compare(got, expected);
  EXPECT_FALSE(cmp.has_nan);
  EXPECT_LT(cmp.max_abs, 1e-3);
  const std::vector<TokenChoice> greedy(6);
  const auto chosen = gpu->forward(batch, greedy).tokens;
  ASSERT_EQ(chosen.size(), 6u);
  for (std::size_t r = 0; r < 6; ++r) {
    const auto row = std::span(expected).subspan(r * vocab, vocab);
    EXPECT_EQ(chosen[r], std::max_element(row.begin(), row.end()) - row.begin()) << "row " << r;
  }
  batch[1].logit_rows = 2;  // a decode of one token
  test::expect_error_containing([&] { (void)gpu->forward(batch, {}); },
                                {"asks for 2 rows of logits"});
}

// Speculative decoding on the cuda backend: the engine verifies prompt lookup's proposals in
// batched steps next to ordinary decodes and prefills, and every request gets the cpu backend's
// greedy tokens without speculation; some proposals are accepted and some rejected (the tiny
// model's greedy outputs loop, where prompt lookup finds them), so the rollback runs too.
TEST(CudaBackend, SpeculationGivesTheCpuBackendsTokens) {
  KVLAB_REQUIRE_CUDA();
  const Params paged{{"block_size", std::int64_t{4}}};
  RunOptions speculating;
  speculating.speculation.tokens = 4;
  const auto requests = workload(10, 16, 36);  // answers long enough to loop (context 64)
  const EngineRun cpu = run_engine(false, "paged", paged, "gqa", {}, "swap", 512, requests);
  const EngineRun gpu =
      run_engine(true, "paged", paged, "gqa", {}, "swap", 512, requests, speculating);
  ASSERT_EQ(gpu.tokens.size(), cpu.tokens.size());
  for (std::size_t i = 0; i < cpu.tokens.size(); ++i)
    EXPECT_EQ(gpu.tokens[i], cpu.tokens[i]) << "request " << i;
  EXPECT_GT(gpu.proposed, 0);
  EXPECT_GT(gpu.accepted, 0);
  EXPECT_LT(gpu.accepted, gpu.proposed);
}

// The GEMMs on cuBLASLt (the default: a plan per shape from Lt's heuristic) and on
// cublasGemmEx give the CPU backend's tokens; a library the backend does not know is refused
// by name.
TEST(CudaBackend, CublasLtAndGemmExGiveTheCpuTokens) {
  KVLAB_REQUIRE_CUDA();
  const std::vector<WorkloadRequest> requests = workload();
  const Params paged{{"block_size", std::int64_t{4}}};
  const EngineRun cpu = run_engine(false, "paged", paged, "gqa", {}, "swap", 72, requests);
  for (const char* gemm : {"cublaslt", "cublas"})
    EXPECT_EQ(run_engine(true, "paged", paged, "gqa", {}, "swap", 72, requests,
                         with_backend_params({{"gemm", gemm}}))
                  .tokens,
              cpu.tokens)
        << gemm;
  const ModelConfig& c = checkpoint().config;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64}, KvStorage::none);
  PluginContext context;
  context.model = &c;
  context.pool = &pool;
  context.weights = &checkpoint_view();
  try {
    (void)backend_registry().create<PluginKind::backend>("cuda", {{"gemm", "cutlass"}}, context);
    FAIL() << "created a cuda backend with gemm = cutlass";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("choose cublaslt or cublas"), std::string::npos)
        << e.what();
  }
}

TEST(CudaBackend, WithoutADeviceTheErrorSaysWhy) {
  const cuda::DeviceProbe probe = cuda::probe_device();
  if (probe.available) GTEST_SKIP() << "a device is present: " << probe.name;
  const ModelConfig& c = checkpoint().config;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64}, KvStorage::none);
  try {
    (void)create_cuda_backend(pool, "f32");
    FAIL() << "created a CUDA backend without a device";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvlab
