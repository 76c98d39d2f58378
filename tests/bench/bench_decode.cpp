// Batched decode through the CPU backend: aggregate tokens/s at batch 1, 8, 32, 64 with
// contexts of 128-255 tokens, 2 threads, weights multiplied in each format (f32, f16, bf16,
// q8_0, q4_0, q4_1) - next to this machine's read bandwidth measured in the same run, and the
// batch-1 roofline (weight bytes per token / bandwidth).
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

void BM_Decode(benchmark::State& state, const std::string& preset, cpu::WeightFormat format) {
  cpu::set_num_threads(kThreads);
  const auto batch = static_cast<std::int64_t>(state.range(0));
  const cpu::LlamaWeights& weights = weights_for(preset);
  const ModelConfig& c = weights.config;
  const std::int64_t max_context = std::min<std::int64_t>(256, c.max_position_embeddings);
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, batch * max_context});
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = max_context;
  auto allocator =
      registry.create<PluginKind::kv_allocator>("paged", {{"prefix_caching", false}}, context);
  // Each sequence holds 128-255 tokens of (arbitrary) KV and decodes its next token.
  std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(batch));
  std::vector<BatchEntry> entries;
  for (std::int64_t s = 0; s < batch; ++s) {
    const std::int64_t length = 128 + (s * 37) % (max_context - 128);
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
  state.SetLabel(preset + " " + backend.matrices().description + ", batch " +
                 std::to_string(batch) + ", ctx 128-255, " + std::to_string(kThreads) + " threads");
}
BENCHMARK_CAPTURE(BM_Decode, tiny, std::string("tiny"), cpu::WeightFormat::f32)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond);
// Every format at batch 1 and 64 (f32 also at 4, 5, 8, 9 and 32: either side of the fused
// kernels' 4-row limit and of 8) for one preset.
#define KVLAB_DECODE_FORMAT(preset, format)                                                      \
  BENCHMARK_CAPTURE(BM_Decode, preset / format, std::string(#preset), cpu::WeightFormat::format) \
      ->Arg(1)                                                                                   \
      ->Arg(64)                                                                                  \
      ->Unit(benchmark::kMillisecond)
#define KVLAB_DECODE_FORMATS(preset)                                                       \
  BENCHMARK_CAPTURE(BM_Decode, preset / f32, std::string(#preset), cpu::WeightFormat::f32) \
      ->Arg(1)                                                                             \
      ->Arg(4)                                                                             \
      ->Arg(5)                                                                             \
      ->Arg(8)                                                                             \
      ->Arg(9)                                                                             \
      ->Arg(32)                                                                            \
      ->Arg(64)                                                                            \
      ->Unit(benchmark::kMillisecond);                                                     \
  KVLAB_DECODE_FORMAT(preset, f16);                                                        \
  KVLAB_DECODE_FORMAT(preset, bf16);                                                       \
  KVLAB_DECODE_FORMAT(preset, q8_0);                                                       \
  KVLAB_DECODE_FORMAT(preset, q4_0);                                                       \
  KVLAB_DECODE_FORMAT(preset, q4_1)
KVLAB_DECODE_FORMATS(stories15m);
KVLAB_DECODE_FORMATS(stories110m);

}  // namespace
}  // namespace kvlab::bench

BENCHMARK_MAIN();
