// A GGUF model file through the CPU backend in the shapes llama.cpp's own benchmarks run, so the
// two can be compared on the same file (tests/bench/compare_llamacpp.sh):
//   prefill/512   one 512-token prompt                      (llama-bench pp512)
//   decode/1      one sequence at 64 cached tokens           (llama-bench tg128: contexts 0-127)
//   decode/64     64 sequences at 128-255 cached tokens     (llama-batched-bench -npp 128
//                                                            -ntg 128 -npl 64)
//   *Loaded       prefill/512 and decode/1 beside busy loops (a shared machine), against the
//                 same steps quiet: slowdown/fair, 1 when the run slows as its fair share does
// decode/1 also reports the memory's limit: MB/token (weights and K/V read once a token), the
// read bandwidth measured in the same run (GB/s) and of_limit = MB/token x tok/s / GB/s.
// Weights are multiplied in the file's stored types ("stored"), or in KVLAB_BENCH_WEIGHTS; the KV
// pool holds KVLAB_BENCH_KV (f32, f16 or bf16; default f16, llama.cpp's default cache type);
// KVLAB_BENCH_ACTIVATIONS=q8 multiplies the Q matrices with 8-bit activations (default f32).
//   KVLAB_BENCH_GGUF=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ./build/bin/kvlab_bench_gguf
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

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

// `count` threads that spin until stopped: another tenant's busy loops on a shared machine.
class BusyLoops {
 public:
  explicit BusyLoops(int count) {
    for (int i = 0; i < count; ++i)
      threads_.emplace_back([this] {
        while (!stop_.load(std::memory_order_relaxed)) {
        }
      });
  }
  ~BusyLoops() { stop(); }
  void stop() {
    stop_.store(true);
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Seconds a step takes on a quiet machine: the median of `steps` (after one to warm up).
double seconds_per_step(cpu::CpuBackend& backend, std::span<const BatchEntry> entries, int steps) {
  (void)backend.run(entries);
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(backend.run(entries));
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + steps / 2, times.end());
  return times[static_cast<std::size_t>(steps / 2)];
}

// The seconds a step takes over the benchmark's iterations, beside `busy_threads` busy loops; with
// busy loops, also the same step's median time without them (measured first) and the slowdown
// over the fair one: our threads among all runnable ones, on the machine's processors.
double time_steps(benchmark::State& state, cpu::CpuBackend& backend,
                  std::span<const BatchEntry> entries, int busy_threads) {
  // One step first in both cases (seconds_per_step warms up too): the pool's pages are touched
  // and zeroed on the first K/V writes (2 MiB at a time with huge pages), a one-off that was 8% of
  // a short Decode64 run. llama-bench and llama-batched-bench warm up as well.
  const double quiet =
      busy_threads > 0 ? seconds_per_step(backend, entries, 20) : (backend.run(entries), 0.0);
  BusyLoops busy(busy_threads);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) benchmark::DoNotOptimize(backend.run(entries));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
      static_cast<double>(state.iterations());
  busy.stop();
  if (busy_threads > 0) {
    const double processors = std::thread::hardware_concurrency();
    const double fair = std::max(1.0, (kThreads + busy_threads) / processors);
    state.counters["quiet_ms"] = quiet * 1e3;
    state.counters["slowdown/fair"] = seconds / quiet / fair;
  }
  return seconds;
}

// The K/V rows of a sequence's `cached` tokens, written with small distinct values: never
// written, the pool's pages would all read as the kernel's one zero page (cached, a fraction of
// the traffic of real K/V) and the attention would be timed on it.
void fill_cached_rows(KvPool& pool, const KvView& view, std::int64_t cached) {
  std::vector<float> row(static_cast<std::size_t>(pool.shape().slot_width()));
  for (std::int64_t i = 0; i < cached; ++i)
    for (std::int64_t layer = 0; layer < pool.shape().layers; ++layer)
      for (const bool value : {false, true}) {
        for (std::size_t j = 0; j < row.size(); ++j)
          row[j] =
              0.01f *
              static_cast<float>(
                  (i * 7 + layer * 3 + static_cast<std::int64_t>(j) + (value ? 1 : 0)) % 17 - 8);
        pool.write_row(layer, view.slot_at(i), value, row.data());
      }
}

// `batch` sequences, sequence s with context(s) cached tokens, each running `new_tokens` tokens,
// beside `busy_threads` busy loops (the quiet figure measured first, without them).
void run_step(benchmark::State& state, std::int64_t batch, std::int64_t new_tokens,
              std::int64_t (*context)(std::int64_t), int busy_threads = 0) {
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
    fill_cached_rows(pool, allocator->view(s), cached);
    entries.push_back({std::span<const std::int32_t>(t).last(static_cast<std::size_t>(new_tokens)),
                       cached, allocator->view(s)});
  }
  cpu::CpuBackend backend(m.weights, pool, std::nullopt, m.matrices);
  const double seconds = time_steps(state, backend, entries, busy_threads);
  state.counters["tok/s"] = static_cast<double>(batch * new_tokens) / seconds;
  if (batch == 1 && new_tokens == 1) {
    // Batch 1 reads every weight byte and the sequence's K/V once a token: the memory's limit.
    const double bytes = static_cast<double>(backend.matrices().bytes()) +
                         static_cast<double>(pool.bytes_per_slot() * (context(0) + 1));
    const double bandwidth = cpu::measured_read_bandwidth_gbs(kThreads) * 1e9;
    state.counters["GB/s"] = bandwidth / 1e9;
    state.counters["MB/token"] = bytes / 1e6;
    state.counters["of_limit"] = bytes / seconds / bandwidth;
  }
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
// A shared machine: the same steps beside as many busy loops as this run has threads (twice as
// many runnable threads as processors on 2 cores: a fair share is half the machine).
// slowdown/fair = (loaded step time / quiet step time) / the fair slowdown; 1 is fair.
void BM_Prefill512Loaded(benchmark::State& state) {
  run_step(
      state, 1, 512, [](std::int64_t) -> std::int64_t { return 0; }, kThreads);
}
void BM_Decode1Loaded(benchmark::State& state) {
  run_step(
      state, 1, 1, [](std::int64_t) -> std::int64_t { return 64; }, kThreads);
}
BENCHMARK(BM_Prefill512)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode64)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Prefill512Loaded)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Decode1Loaded)->Unit(benchmark::kMillisecond)->UseRealTime();

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
