// Batched decode through the CPU backend: aggregate tokens/s at batch 1, 8, 32, 64 with
// contexts of 128-255 tokens (batch/256 in a name), 2 threads, weights multiplied in each format
// (f32, f16, bf16, q8_0, q4_0, q4_1) - next to this machine's read bandwidth measured in the same
// run, and the batch-1 roofline (weight bytes per token / bandwidth); and each KV pool dtype
// (kv_*).
//   ./build/bin/kvlab_bench_decode --benchmark_filter=stories110m/q4_1
#include <benchmark/benchmark.h>

#include <map>
#include <memory>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/machine_peak.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::bench {
namespace {
using cpu::measured_fp32_peak_gflops;
using cpu::measured_read_bandwidth_gbs;

constexpr int kThreads = 2;

const cpu::LlamaWeights& weights_for(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<cpu::LlamaWeights>> cache;
  auto& slot = cache[preset];
  if (!slot)
    slot = std::make_unique<cpu::LlamaWeights>(cpu::random_llama_weights(model_preset(preset), 0));
  return *slot;
}

void BM_ReadBandwidth(benchmark::State& state) {
  double gbs = 0;
  for (auto _ : state) gbs = measured_read_bandwidth_gbs(kThreads);
  state.counters["GB/s"] = gbs;
}
BENCHMARK(BM_ReadBandwidth)->Iterations(1)->Unit(benchmark::kMillisecond);

void BM_Decode(benchmark::State& state, const std::string& preset, cpu::WeightFormat format,
               DType kv = DType::dtype_f32) {
  cpu::set_num_threads(kThreads);
  const auto batch = static_cast<std::int64_t>(state.range(0));
  const cpu::LlamaWeights& weights = weights_for(preset);
  const ModelConfig& c = weights.config;
  const std::int64_t max_context =
      std::min<std::int64_t>(state.range(1), c.max_position_embeddings);
  const std::int64_t half = max_context / 2;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, batch * max_context, kv});
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = max_context;
  // KIVI's key groups are 32 slots of one block.
  const std::int64_t block_size = dtype_is_kivi(kv) ? 32 : 16;
  auto allocator = registry.create<PluginKind::kv_allocator>(
      "paged", {{"prefix_caching", false}, {"block_size", block_size}}, context);
  // Each sequence holds max/2 to max - 1 tokens of (arbitrary) KV and decodes its next token.
  std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(batch));
  std::vector<BatchEntry> entries;
  for (std::int64_t s = 0; s < batch; ++s) {
    const std::int64_t length = half + (s * 37) % half;
    auto& t = tokens[static_cast<std::size_t>(s)];
    for (std::int64_t i = 0; i <= length; ++i)
      t.push_back(static_cast<std::int32_t>((i * 131 + s) % c.vocab_size));
    allocator->allocate({s, t, length + 1});
    entries.push_back({std::span<const std::int32_t>(t).last(1), length, allocator->view(s)});
  }
  cpu::CpuBackend backend(
      weights, pool, std::nullopt,
      cpu::with_activations(cpu::compute_weights(weights, format), cpu::ActivationFormat::f32));
  for (auto _ : state) benchmark::DoNotOptimize(backend.run(entries));  // rewrites the same slots
  const auto weight_bytes = static_cast<double>(backend.matrices().bytes());
  const double bandwidth = measured_read_bandwidth_gbs(kThreads) * 1e9;
  state.counters["tok/s"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["roofline_b1_tok/s"] = bandwidth / weight_bytes;
  state.counters["GB/s"] = bandwidth / 1e9;
  state.counters["kv_bytes_per_token"] = static_cast<double>(pool.bytes_per_slot());
  state.SetLabel(preset + " " + backend.matrices().description + ", KV " +
                 std::string(dtype_short_name(kv)) + ", batch " + std::to_string(batch) + ", ctx " +
                 std::to_string(half) + "-" + std::to_string(max_context - 1) + ", " +
                 std::to_string(kThreads) + " threads");
}
BENCHMARK_CAPTURE(BM_Decode, tiny, std::string("tiny"), cpu::WeightFormat::f32)
    ->Args({1, 256})
    ->Unit(benchmark::kMillisecond);
// Every format at batch 1 and 64 (f32 also at 4, 5, 8, 9 and 32: either side of the fused
// kernels' 4-row limit and of 8) for one preset.
#define KVLAB_DECODE_FORMAT(preset, format)                                                      \
  BENCHMARK_CAPTURE(BM_Decode, preset / format, std::string(#preset), cpu::WeightFormat::format) \
      ->Args({1, 256})                                                                           \
      ->Args({64, 256})                                                                          \
      ->Unit(benchmark::kMillisecond)
#define KVLAB_DECODE_FORMATS(preset)                                                       \
  BENCHMARK_CAPTURE(BM_Decode, preset / f32, std::string(#preset), cpu::WeightFormat::f32) \
      ->Args({1, 256})                                                                     \
      ->Args({4, 256})                                                                     \
      ->Args({5, 256})                                                                     \
      ->Args({8, 256})                                                                     \
      ->Args({9, 256})                                                                     \
      ->Args({32, 256})                                                                    \
      ->Args({64, 256})                                                                    \
      ->Unit(benchmark::kMillisecond);                                                     \
  KVLAB_DECODE_FORMAT(preset, f16);                                                        \
  KVLAB_DECODE_FORMAT(preset, bf16);                                                       \
  KVLAB_DECODE_FORMAT(preset, q8_0);                                                       \
  KVLAB_DECODE_FORMAT(preset, q4_0);                                                       \
  KVLAB_DECODE_FORMAT(preset, q4_1)
KVLAB_DECODE_FORMATS(stories15m);
KVLAB_DECODE_FORMATS(stories110m);

// The KV pool's dtype at batch 1 and 64 (q8_0 weights), contexts 128-255 and 512-1023: at 64
// sequences the step reads more KV than weights (f16 at 512-1023: 1.8 GB a step), so 8-bit KV
// (about half of f16's bytes, scales included) shows in the step time. stories110m: head_dim 64,
// 12 K/V heads.
#define KVLAB_DECODE_KV(dtype, name)                                                \
  BENCHMARK_CAPTURE(BM_Decode, stories110m / kv_##name, std::string("stories110m"), \
                    cpu::WeightFormat::q8_0, DType::dtype)                          \
      ->Args({1, 256})                                                              \
      ->Args({64, 256})                                                             \
      ->Args({64, 1024})                                                            \
      ->Unit(benchmark::kMillisecond)
KVLAB_DECODE_KV(dtype_f32, f32);
KVLAB_DECODE_KV(dtype_f16, f16);
KVLAB_DECODE_KV(dtype_bf16, bf16);
KVLAB_DECODE_KV(dtype_f8_e4m3, fp8);
KVLAB_DECODE_KV(dtype_kv_int8, int8);
KVLAB_DECODE_KV(dtype_q8_0, q8_0);
KVLAB_DECODE_KV(dtype_q4_0, q4_0);
KVLAB_DECODE_KV(dtype_q4_1, q4_1);
KVLAB_DECODE_KV(dtype_kv_int2, int2);
KVLAB_DECODE_KV(dtype_kivi2, kivi2);  // each sequence's last group open: fp16 beside the pool
KVLAB_DECODE_KV(dtype_kivi4, kivi4);

}  // namespace
}  // namespace kvlab::bench

BENCHMARK_MAIN();
