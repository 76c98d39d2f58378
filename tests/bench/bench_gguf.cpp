// A GGUF model file through the CPU backend in the shapes llama.cpp's own benchmarks run, so the
// two can be compared on the same file (tests/bench/compare_llamacpp.sh):
//   prefill/512   one 512-token prompt                      (llama-bench pp512)
//   decode/1      one sequence at 64 cached tokens           (llama-bench tg128: contexts 0-127)
//   decode/64     64 sequences at 128-255 cached tokens     (llama-batched-bench -npp 128
//                                                            -ntg 128 -npl 64)
// Weights are multiplied in the file's stored types ("stored"), or in KVLAB_BENCH_WEIGHTS; the KV
// pool holds KVLAB_BENCH_KV (f32, f16 or bf16; default f16, llama.cpp's default cache type);
// KVLAB_BENCH_ACTIVATIONS=q8 multiplies the Q matrices with 8-bit activations (default f32).
//   KVLAB_BENCH_GGUF=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ./build/bin/kvlab_bench_gguf
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/machine_peak.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::bench {
namespace {

constexpr int kThreads = 2;

struct Model {
  std::string path;
  cpu::LlamaWeights weights;
  cpu::ComputeWeights matrices;
};

const Model& model() {
  static const std::unique_ptr<Model> loaded = [] {
    const char* path = std::getenv("KVLAB_BENCH_GGUF");
    const char* format = std::getenv("KVLAB_BENCH_WEIGHTS");
    const char* activations = std::getenv("KVLAB_BENCH_ACTIVATIONS");
    auto m = std::make_unique<Model>();
    m->path = path;
    m->weights = cpu::load_llama_weights(m->path);
    m->matrices = cpu::select_compute_weights(m->weights, m->path, format ? format : "stored",
                                              activations ? activations : "f32");
    return m;
  }();
  return *loaded;
}

// `batch` sequences, sequence s with context(s) cached tokens, each running `new_tokens` tokens.
void run_step(benchmark::State& state, std::int64_t batch, std::int64_t new_tokens,
              std::int64_t (*context)(std::int64_t)) {
  cpu::set_num_threads(kThreads);
  const Model& m = model();
  const ModelConfig& c = m.weights.config;
  new_tokens = std::min(new_tokens, c.max_position_embeddings);  // small models (the smoke test)
  const char* kv = std::getenv("KVLAB_BENCH_KV");
  const auto kv_dtype = dtype_from_short_name(kv ? kv : "f16");
  if (!kv_dtype) throw Error(fmt::format("KVLAB_BENCH_KV={}: f32, f16 or bf16", kv));
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, batch * 512, *kv_dtype});
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext plugin_context;
  plugin_context.pool = &pool;
  plugin_context.max_seq_len = 512;
  auto allocator = registry.create<PluginKind::kv_allocator>("paged", {{"prefix_caching", false}},
                                                             plugin_context);
  std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(batch));
  std::vector<BatchEntry> entries;
  for (std::int64_t s = 0; s < batch; ++s) {
    const std::int64_t cached = std::min(context(s), c.max_position_embeddings - new_tokens);
    auto& t = tokens[static_cast<std::size_t>(s)];
    for (std::int64_t i = 0; i < cached + new_tokens; ++i)
      t.push_back(static_cast<std::int32_t>((i * 131 + s) % c.vocab_size));
    allocator->allocate({s, t, cached + new_tokens});
    entries.push_back({std::span<const std::int32_t>(t).last(static_cast<std::size_t>(new_tokens)),
                       cached, allocator->view(s)});
  }
  cpu::CpuBackend backend(m.weights, pool, std::nullopt, m.matrices);
  for (auto _ : state) benchmark::DoNotOptimize(backend.run(entries));
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(batch * new_tokens),
                                               benchmark::Counter::kIsIterationInvariantRate);
  const double flops_per_token = 2.0 * static_cast<double>(c.matmul_parameter_count());
  state.counters["ceiling_tok/s"] =
      cpu::measured_fp32_peak_gflops(kThreads) * 1e9 / flops_per_token;
  state.SetLabel(m.path + " (" + m.matrices.description + "; KV " +
                 std::string(dtype_short_name(*kv_dtype)) + "), " + std::to_string(kThreads) +
                 " threads");
}

void BM_Prefill512(benchmark::State& state) {
  run_step(state, 1, 512, [](std::int64_t) -> std::int64_t { return 0; });
}
void BM_Decode1(benchmark::State& state) {
  run_step(state, 1, 1, [](std::int64_t) -> std::int64_t { return 64; });
}
void BM_Decode64(benchmark::State& state) {
  run_step(state, 64, 1, [](std::int64_t s) { return 128 + (s * 37) % 128; });
}
BENCHMARK(BM_Prefill512)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode64)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvlab::bench

int main(int argc, char** argv) {
  if (std::getenv("KVLAB_BENCH_GGUF") == nullptr) {
    std::fprintf(stderr, "kvlab_bench_gguf: set KVLAB_BENCH_GGUF to a .gguf model file\n");
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
