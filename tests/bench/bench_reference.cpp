// Full-recompute prefill of the Eigen reference: tokens/s, achieved GFLOP/s, and the share of
// this machine's FP32 peak measured in the same run.
// And one weight product by the rows of x: what a speculative verify entry of k + 1 tokens costs
// against a decode's single row (SmolLM2-135M's tied LM head, 49152 x 576, 17 MB of Q4_1 blocks as
// stored, read from memory; fp32 activations).
//   ./build/bin/kvlab_bench_reference            (2 threads, as in docs/benchmarks.md)
#include <benchmark/benchmark.h>

#include <map>
#include <memory>

#include "kvlab/cpu_reference/machine_peak.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"

namespace kvlab::bench {
namespace {
using cpu::measured_fp32_peak_gflops;
using cpu::measured_read_bandwidth_gbs;

constexpr int kThreads = 2;

const cpu::ReferenceModel& model_for(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<cpu::ReferenceModel>> models;
  auto& slot = models[preset];
  if (!slot)
    slot =
        std::make_unique<cpu::ReferenceModel>(cpu::random_llama_weights(model_preset(preset), 0));
  return *slot;
}

void BM_Fp32Peak(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  double gflops = 0;
  for (auto _ : state) gflops = measured_fp32_peak_gflops(threads);
  state.counters["GFLOP/s"] = gflops;
}
BENCHMARK(BM_Fp32Peak)->Arg(kThreads)->Iterations(1)->Unit(benchmark::kMillisecond);

void BM_Prefill(benchmark::State& state, const std::string& preset) {
  cpu::set_num_threads(kThreads);
  const auto tokens = static_cast<std::int64_t>(state.range(0));
  const cpu::ReferenceModel& model = model_for(preset);
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(tokens));
  for (std::int64_t i = 0; i < tokens; ++i)
    prompt[static_cast<std::size_t>(i)] =
        static_cast<std::int32_t>((i * 7919 + 1) % model.config().vocab_size);
  cpu::ForwardOptions options;
  options.last_position_only = true;  // prefill: logits for the last position only
  for (auto _ : state) benchmark::DoNotOptimize(model.forward(prompt, options));
  const double flops = forward_flops(model.config(), tokens, 1);
  const double peak = measured_fp32_peak_gflops(kThreads);
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(tokens),
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOP/s"] = peak;
  state.counters["of_peak"] =
      benchmark::Counter(flops / 1e9 / peak, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(preset + ", " + std::to_string(kThreads) + " threads, fp32");
}
BENCHMARK_CAPTURE(BM_Prefill, tiny, std::string("tiny"))->Arg(64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, stories15m, std::string("stories15m"))
    ->Arg(256)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, stories110m, std::string("stories110m"))
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// y = x w^T for x of `rows` rows (state.range(0)): time per product and per row.
void BM_QProductByRows(benchmark::State& state) {
  cpu::set_num_threads(kThreads);
  const auto rows = static_cast<Eigen::Index>(state.range(0));
  static const cpu::WeightMatrix w = cpu::WeightMatrix::quantize(
      cpu::RowMatrix::Random(49152, 576) * 0.05f, cpu::WeightFormat::q4_1);
  const cpu::RowMatrix x = cpu::RowMatrix::Random(rows, 576);
  cpu::RowMatrix y;
  for (auto _ : state) {
    cpu::multiply_by_transposed(x, w, y, false);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["rows/s"] =
      benchmark::Counter(static_cast<double>(rows), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("q4_1 49152x576, fp32 activations, " + std::to_string(kThreads) + " threads");
}
BENCHMARK(BM_QProductByRows)->DenseRange(1, 9)->Arg(16)->Arg(32)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvlab::bench

BENCHMARK_MAIN();
