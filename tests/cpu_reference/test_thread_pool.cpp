// The CPU backend's thread pool (thread_pool.hpp, parallel.hpp): every item of a shared loop runs
// exactly once, whoever joins; a loop ends only when all its items are done (the next loop of the
// region reads what it wrote); nested regions and one-thread pools run on the calling thread;
// BLAS sees one thread inside a region; idle workers that went to sleep wake for the next region
// and stop when the pool goes. And the backend's logits do not depend on the thread count: each
// output is summed by one thread in one order, so 1 and 2 threads agree bit for bit, in every
// kernel (fused rows, panels, tiles, interleaved q8/bf16 groups over several 128-row passes).
// Speed and fairness under load are the benchmark's (kvlab_bench_gguf), never asserted here.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "parallel.hpp"
#include "test_models.hpp"
#include "thread_pool.hpp"

namespace kvlab::cpu {
namespace {

TEST(ThreadPool, EveryItemOfEveryLoopRunsOnceAndTheNextLoopSeesIt) {
  ThreadPool pool(3);  // the caller and two workers, whatever the processors
  constexpr std::int64_t kItems = 1000;
  std::vector<std::atomic<int>> runs(kItems);
  std::vector<std::int64_t> first(kItems), second(kItems);
  std::atomic<int> joined_threads{0};
  for (int region = 0; region < 200; ++region) {
    auto job = [&] {
      joined_threads.fetch_add(1);
      shared_loop(kItems, [&](std::int64_t i) {
        runs[static_cast<std::size_t>(i)].fetch_add(1);
        first[static_cast<std::size_t>(i)] = i * region;
      });
      // Reads items other threads wrote: only right if the first loop ended everywhere.
      shared_loop<LoopSchedule::one_at_a_time>(kItems, [&](std::int64_t i) {
        second[static_cast<std::size_t>(i)] = first[static_cast<std::size_t>(kItems - 1 - i)] + 1;
      });
    };
    pool.run(job);
    for (std::int64_t i = 0; i < kItems; ++i) {
      ASSERT_EQ(runs[static_cast<std::size_t>(i)].exchange(0), 1) << "item " << i;
      ASSERT_EQ(second[static_cast<std::size_t>(i)], (kItems - 1 - i) * region + 1);
    }
  }
  EXPECT_GE(joined_threads.load(), 200);  // the caller at least; workers when they came in time
  EXPECT_LE(joined_threads.load(), 600);
}

TEST(ThreadPool, WorkersAsleepWakeForTheNextRegion) {
  ThreadPool pool(2);
  std::atomic<int> on_worker{0};
  const std::thread::id caller = std::this_thread::get_id();
  auto job = [&] {
    if (std::this_thread::get_id() != caller) on_worker.fetch_add(1);
    shared_loop<LoopSchedule::one_at_a_time>(
        64, [](std::int64_t) { std::this_thread::sleep_for(std::chrono::microseconds(200)); });
  };
  for (int round = 0; round < 3; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past spinning and yielding
    pool.run(job);
  }
  // 64 items of 200 us: a worker that sleeps through them all three times would be a lost wake.
  EXPECT_GE(on_worker.load(), 1);
}

TEST(ThreadPool, InsideARegionBlasAndNestedLoopsRunOnOneThread) {
  ThreadPool pool(3);
  const int outside = omp_get_max_threads();
  std::atomic<int> wrong_icv{0}, nested_on_other_threads{0};
  auto job = [&] {
    if (omp_get_max_threads() != 1) wrong_icv.fetch_add(1);
    EXPECT_EQ(pool_for_region(), nullptr);  // a nested region gets no threads
    const std::thread::id me = std::this_thread::get_id();
    shared_loop(8, [&](std::int64_t) {
      parallel_for(100, [&](std::int64_t) {
        if (std::this_thread::get_id() != me) nested_on_other_threads.fetch_add(1);
      });
    });
  };
  pool.run(job);
  EXPECT_EQ(wrong_icv.load(), 0);
  EXPECT_EQ(nested_on_other_threads.load(), 0);
  EXPECT_EQ(omp_get_max_threads(), outside) << "the caller's OpenMP threads come back";
}

TEST(ThreadPool, OutsideARegionALoopIsAPlainLoop) {
  std::vector<std::int64_t> order;
  shared_loop(5, [&](std::int64_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
}

TEST(ThreadPoolDeathTest, MoreLoopsThanARegionHoldsStopsWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        ThreadPool pool(2);
        auto job = [] {
          for (int loop = 0; loop <= ThreadPool::kMaxLoops; ++loop) shared_loop(4, [](auto) {});
        };
        pool.run(job);
      },
      "more than 4 shared loops");
}

// 1 and 2 threads give the same bits: formats x activations x (a 200-token prefill over two
// 128-row passes, decodes of 3 and 9 sequences).
TEST(ThreadPool, BackendLogitsDoNotDependOnTheThreadCount) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one processor";
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 5);
  const ModelConfig& c = weights.config;
  struct Setting {
    WeightFormat format;
    ActivationFormat activations;
  };
  const Setting settings[] = {
      {WeightFormat::f32, ActivationFormat::f32},   {WeightFormat::f16, ActivationFormat::f32},
      {WeightFormat::bf16, ActivationFormat::bf16}, {WeightFormat::q8_0, ActivationFormat::q8},
      {WeightFormat::q4_0, ActivationFormat::q8},   {WeightFormat::q4_1, ActivationFormat::f32}};
  std::vector<std::int32_t> tokens(220);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 512);
  const int threads = num_threads();
  for (const Setting& s : settings) {
    std::vector<RowMatrix> logits[2];
    for (const int t : {1, 2}) {
      set_num_threads(t);
      KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 2048});
      CpuBackend backend(weights, pool, std::nullopt,
                         with_activations(compute_weights(weights, s.format), s.activations));
      const BatchEntry prefill{std::span(tokens).first(200), 0, KvView{{{0, 200}}, 0, {}}};
      logits[t - 1].push_back(backend.run({&prefill, 1}));
      for (const std::int64_t batch : {3, 9}) {
        std::vector<BatchEntry> decodes;
        for (std::int64_t e = 0; e < batch; ++e)  // each its own copy of the prompt's first slots
          decodes.push_back({std::span(tokens).subspan(static_cast<std::size_t>(100 + e), 1),
                             100 + e, KvView{{{0, 100 + e + 1}}, 0, {}}});
        logits[t - 1].push_back(backend.run(decodes));
      }
    }
    for (std::size_t run = 0; run < logits[0].size(); ++run)
      EXPECT_EQ(logits[0][run], logits[1][run])
          << weight_format_name(s.format) << " activations "
          << activation_format_name(s.activations) << ", run " << run;
  }
  set_num_threads(threads);
}

// One sequence's prompt over a single K/V head (MQA, Gemma 3's shape) is one attention task; at
// 2 threads it is split into parts of its query heads (each part its own products): the logits
// are those of one thread, to fp32 rounding.
TEST(ThreadPool, APromptOfOneKvHeadIsSplitByQueryHeadsAndKeepsItsLogits) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one processor";
  ModelConfig config = model_preset("tiny");
  config.num_key_value_heads = 1;  // 4 query heads over one K/V head
  const LlamaWeights weights = random_llama_weights(config, 8);
  std::vector<std::int32_t> tokens(150);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::int32_t>((i * 53 + 7) % 512);
  const int threads = num_threads();
  RowMatrix logits[2];
  for (const int t : {1, 2}) {
    set_num_threads(t);
    KvPool pool({config.num_hidden_layers, 1, config.head_dim, 256});
    CpuBackend backend(weights, pool, std::nullopt);
    BatchEntry prefill{tokens, 0, KvView{{{0, 150}}, 0, {}}};
    prefill.logit_rows = 150;
    logits[t - 1] = backend.run({&prefill, 1});
  }
  set_num_threads(threads);
  ASSERT_EQ(logits[0].rows(), 150);
  const float worst = (logits[0] - logits[1]).cwiseAbs().maxCoeff();
  EXPECT_LT(worst, 1e-4f) << "logits O(1)";
}

}  // namespace
}  // namespace kvlab::cpu
