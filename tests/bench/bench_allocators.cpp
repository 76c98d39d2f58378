// KV allocator operations per second with 10,000 live sequences: the hot path of an engine
// step (append one token to a running sequence, mark it computed) plus, every 64 appends to a
// sequence, its finish and a new admission (free + allocate of a 32-token prompt); and the
// paged allocator's prefix-caching admission of a prompt behind a cached system prompt.
//   ./build/bin/kvlab_bench_allocators
#include <benchmark/benchmark.h>

#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::bench {
namespace {

constexpr std::int64_t kLive = 10'000;
constexpr std::int64_t kPrompt = 32;
constexpr std::int64_t kAppendsPerSequence = 64;

void BM_AllocatorOps(benchmark::State& state, const std::string& name,
                     const std::map<std::string, ParamValue, std::less<>>& params) {
  const std::int64_t max_len = kPrompt + kAppendsPerSequence;
  KvPool pool({1, 1, 1, 2 * kLive * 128});  // a 1-float slot: the bookkeeping is what is measured
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = max_len;
  auto allocator = registry.create<PluginKind::kv_allocator>(name, params, context);
  std::vector<std::int32_t> prompt(kPrompt);
  std::vector<std::int64_t> appended(kLive, 0);
  std::vector<SequenceId> ids(kLive);
  SequenceId next = 0;
  for (std::int64_t s = 0; s < kLive; ++s) {
    for (std::int64_t i = 0; i < kPrompt; ++i)
      prompt[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((s * 7 + i) % 1000);
    ids[static_cast<std::size_t>(s)] = next;
    if (!allocator->allocate({next++, prompt, max_len})) state.SkipWithError("pool too small");
  }
  std::int64_t cursor = 0, operations = 0;
  const std::int32_t token = 5;
  for (auto _ : state) {
    const auto s = static_cast<std::size_t>(cursor++ % kLive);
    if (appended[s] == kAppendsPerSequence) {
      allocator->free(ids[s]);
      for (std::int64_t i = 0; i < kPrompt; ++i)
        prompt[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((cursor + i) % 1000);
      ids[s] = next;
      benchmark::DoNotOptimize(allocator->allocate({next++, prompt, max_len}));
      appended[s] = 0;
      operations += 2;
    } else {
      benchmark::DoNotOptimize(allocator->append(ids[s], std::span<const std::int32_t>(&token, 1)));
      allocator->mark_computed(ids[s], kPrompt + appended[s]);
      ++appended[s];
      operations += 1;
    }
  }
  state.counters["ops/s"] =
      benchmark::Counter(static_cast<double>(operations), benchmark::Counter::kIsRate);
  state.counters["live"] = static_cast<double>(allocator->stats().live_sequences);
}
BENCHMARK_CAPTURE(BM_AllocatorOps, static, std::string("static"), {});
BENCHMARK_CAPTURE(BM_AllocatorOps, dynamic, std::string("dynamic"), {});
BENCHMARK_CAPTURE(BM_AllocatorOps, paged, std::string("paged"), {});
BENCHMARK_CAPTURE(BM_AllocatorOps, paged_no_prefix_cache, std::string("paged"),
                  {{"prefix_caching", false}});

// Prefix-caching admission as the engine drives it: a request whose 1,088-token prompt starts
// with a cached 1,024-token system prompt (64 blocks of 16) is checked at arrival
// (slots_to_allocate), planned (plan_reset + plan_allocate), allocated, and later freed; its
// prompt's block hashes are kept with the request (RequestState::prefix_hashes), as the engine
// keeps them. ns per admission (the four calls and the free).
void BM_PrefixCachingAdmission(benchmark::State& state) {
  constexpr std::int64_t kSystem = 1024, kOwn = 64;
  KvPool pool({1, 1, 1, 1 << 16});
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = 2 * (kSystem + kOwn);
  auto allocator = registry.create<PluginKind::kv_allocator>("paged", {}, context);
  std::vector<std::int32_t> prompt(kSystem + kOwn);
  for (std::int64_t i = 0; i < kSystem; ++i) prompt[static_cast<std::size_t>(i)] = 100 + i % 900;
  SequenceId next = 0;
  if (!allocator->allocate({next++, std::span(prompt).first(kSystem), kSystem + 1}))
    state.SkipWithError("pool too small");
  allocator->mark_computed(0, kSystem);  // the system prompt's blocks are cached and held
  std::int64_t hits = 0;
  for (auto _ : state) {
    for (std::int64_t i = kSystem; i < kSystem + kOwn; ++i)
      prompt[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((next * 31 + i) % 1000);
    PrefixHashCache hashes;  // the request's own, new with it
    const AllocateRequest request{next, prompt, kSystem + kOwn + 16, &hashes};
    benchmark::DoNotOptimize(allocator->slots_to_allocate(request));
    allocator->plan_reset();
    benchmark::DoNotOptimize(allocator->plan_allocate(request));
    const auto result = allocator->allocate(request);
    hits += result ? result->cached_tokens : 0;
    allocator->free(next++);
  }
  state.counters["hit_tokens"] =
      static_cast<double>(hits) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_PrefixCachingAdmission);

}  // namespace
}  // namespace kvlab::bench

BENCHMARK_MAIN();
