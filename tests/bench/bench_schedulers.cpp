// Scheduler step overhead: one schedule() call with 256 running and 10,000 waiting requests
// (of eight tenants, with deadlines),
// against the paged allocator (the plan is computed, not applied, so every iteration sees the
// same state). Microseconds per step, each scheduler.
//   ./build/bin/kvlab_bench_schedulers
#include <benchmark/benchmark.h>

#include <string>

#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::bench {
namespace {

constexpr std::int64_t kRunning = 256, kWaiting = 10'000;

void BM_SchedulerStep(benchmark::State& state, const std::string& name) {
  KvPool pool({1, 1, 1, 256 * 1024});
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = 4096;
  auto allocator = registry.create<PluginKind::kv_allocator>("paged", {}, context);
  auto scheduler = registry.create<PluginKind::scheduler>(name, {}, context);
  std::vector<RequestState> states(kRunning + kWaiting);
  std::vector<const RequestState*> running, waiting;
  for (std::int64_t i = 0; i < kRunning + kWaiting; ++i) {
    RequestState& r = states[static_cast<std::size_t>(i)];
    const std::int64_t length = 64 + (i * 37) % 448;
    for (std::int64_t k = 0; k < length; ++k)
      r.tokens.push_back(static_cast<std::int32_t>((i * 131 + k) % 32000));
    r.id = i;
    r.arrival_s = static_cast<double>(i) * 1e-3;
    r.priority = static_cast<int>(i % 3);
    r.tenant = "tenant" + std::to_string(i % 8);  // eight tenants (vtc), two deadlines (edf)
    r.ttft_deadline_s = r.arrival_s + (i % 2 ? 1.0 : 30.0);
    r.prompt_tokens = length;
    r.max_new_tokens = 1 + (i * 7) % 128;
    if (i < kRunning) {  // running and decoding: all but the newest token computed
      r.prompt_tokens = length - 1;
      allocator->allocate({i, r.tokens, length + 128});
      r.computed = r.allocated = length - 1;
      r.admitted_step = i;
      r.status = RequestStatus::running;
      running.push_back(&r);
    } else {
      waiting.push_back(&r);
    }
  }
  std::int64_t planned = 0;
  for (auto _ : state) {
    const StepPlan plan = scheduler->schedule({waiting, running, allocator.get(), 0, 5.0});
    planned += static_cast<std::int64_t>(plan.work.size());
    benchmark::DoNotOptimize(plan);
  }
  state.counters["scheduled/step"] =
      static_cast<double>(planned) / static_cast<double>(state.iterations());
}
BENCHMARK_CAPTURE(BM_SchedulerStep, static, std::string("static"))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, fcfs, std::string("fcfs"))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, priority, std::string("priority"))
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, chunked, std::string("chunked"))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, sjf_oracle, std::string("sjf_oracle"))
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, edf, std::string("edf"))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SchedulerStep, vtc, std::string("vtc"))->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvlab::bench

BENCHMARK_MAIN();
