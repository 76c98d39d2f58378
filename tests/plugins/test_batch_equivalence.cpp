// Correctness rung 2: every allocator x attention variant, batch of 1 and of 7 mixed
// lengths (prefills mixed with decodes), gives the greedy tokens of the full-recompute
// reference on the same (converted) weights, with logits within 1e-4.
#include <gtest/gtest.h>

#include "cpu_reference/test_models.hpp"
#include "kvlab/cpu_reference/batch_generator.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using cpu::BatchRequest;

struct AllocatorSetup {
  const char* label;
  const char* name;
  std::map<std::string, ParamValue, std::less<>> params;
};
struct VariantSetup {
  const char* label;
  const char* name;
  std::map<std::string, ParamValue, std::less<>> params;
};

const std::vector<AllocatorSetup> kAllocators{
    {"static", "static", {}},
    {"dynamic", "dynamic", {}},
    {"paged", "paged", {{"block_size", std::int64_t{4}}}},
};
const std::vector<VariantSetup> kVariants{
    {"mha", "mha", {}},
    {"gqa", "gqa", {}},  // the tiny preset's own 2 KV heads for 4 query heads
    {"mqa", "mqa", {}},
    {"sliding_window", "sliding_window", {{"window", std::int64_t{6}}}},
    {"recompute", "recompute", {}},
};

const cpu::LlamaWeights& checkpoint() {
  static const cpu::LlamaWeights weights = test::scaled_random_weights(model_preset("tiny"), 77);
  return weights;
}

std::vector<BatchRequest> make_requests(int batch) {
  std::vector<BatchRequest> requests;
  for (int i = 0; i < batch; ++i) {
    BatchRequest r;
    const int length = batch == 1 ? 9 : 3 + 5 * i;  // 3, 8, ..., 33: mixed lengths
    for (int t = 0; t < length; ++t) r.prompt.push_back((t * 31 + i * 7 + 1) % 512);
    r.sampling.max_tokens = 6 + i % 3;
    r.sampling.ignore_eos = true;
    r.arrival_step = batch == 1 ? 0 : i / 2;  // later arrivals prefill while earlier ones decode
    requests.push_back(r);
  }
  return requests;
}

// Checks each generated token against the reference's full recompute of the same prefix.
void expect_matches_reference(const cpu::LlamaWeights& weights, std::optional<std::int64_t> window,
                              const std::vector<BatchRequest>& requests,
                              const std::vector<cpu::BatchResult>& results) {
  const cpu::ReferenceModel reference(weights);
  cpu::ForwardOptions options;
  options.last_position_only = true;
  options.sliding_window = window;
  double max_abs = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(results[i].tokens.size(), static_cast<std::size_t>(requests[i].sampling.max_tokens))
        << "request " << i;
    std::vector<std::int32_t> sequence = requests[i].prompt;
    for (std::size_t t = 0; t < results[i].tokens.size(); ++t) {
      const cpu::RowMatrix expected = reference.forward(sequence, options);
      Eigen::Index argmax = 0;
      expected.row(0).maxCoeff(&argmax);
      EXPECT_EQ(results[i].tokens[t], argmax) << "request " << i << " token " << t;
      const auto c = test::compare(
          results[i].logits[t],
          std::span<const float>(expected.data(), static_cast<std::size_t>(expected.cols())));
      ASSERT_FALSE(c.has_nan) << "request " << i << " token " << t;
      max_abs = std::max(max_abs, c.max_abs);
      sequence.push_back(results[i].tokens[t]);
    }
  }
  EXPECT_LT(max_abs, 1e-4) << "max abs logit error vs the reference (logits are O(1)-O(10))";
}

using EquivalenceParam = std::tuple<std::size_t, std::size_t, int>;  // allocator, variant, batch

class BatchEquivalence : public ::testing::TestWithParam<EquivalenceParam> {};

TEST_P(BatchEquivalence, GreedyTokensAndLogitsMatchTheReference) {
  const auto [allocator_index, variant_index, batch] = GetParam();
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  cpu::BatchSetup setup;
  setup.allocator = kAllocators[allocator_index].name;
  setup.allocator_params = kAllocators[allocator_index].params;
  setup.attention = kVariants[variant_index].name;
  setup.attention_params = kVariants[variant_index].params;
  setup.pool_slots = 1024;
  setup.max_seq_len = 64;
  cpu::BatchGenerator generator(checkpoint(), registry, setup);
  cpu::BatchOptions options;
  options.record_logits = true;
  const auto requests = make_requests(batch);
  const auto results = generator.run(requests, options);
  expect_matches_reference(generator.weights(), generator.attention().window(), requests, results);
  const KvAllocatorStats stats = generator.allocator().stats();
  EXPECT_EQ(stats.live_sequences, 0);
  EXPECT_EQ(stats.used, 0);
}

INSTANTIATE_TEST_SUITE_P(AllocatorsByVariants, BatchEquivalence,
                         ::testing::Combine(::testing::Range<std::size_t>(0, 3),
                                            ::testing::Range<std::size_t>(0, 5),
                                            ::testing::Values(1, 7)),
                         [](const auto& info) {
                           return std::string(kAllocators[std::get<0>(info.param)].label) + "_" +
                                  kVariants[std::get<1>(info.param)].label + "_batch" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(BatchGeneration, ChunkedPrefillGivesTheSameTokens) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  cpu::BatchSetup setup;
  setup.allocator_params = {{"block_size", std::int64_t{4}}};
  setup.pool_slots = 1024;
  cpu::BatchGenerator generator(checkpoint(), registry, setup);
  cpu::BatchOptions options;
  options.record_logits = true;
  options.prefill_chunk = 5;
  const auto requests = make_requests(7);
  expect_matches_reference(generator.weights(), std::nullopt, requests,
                           generator.run(requests, options));
}

TEST(BatchGeneration, PrefixCachingHitsAndKeepsTheLogits) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  std::vector<BatchRequest> requests(2);
  for (int t = 0; t < 20; ++t) requests[0].prompt.push_back(100 + t);  // shared system prompt
  requests[1].prompt = requests[0].prompt;
  requests[0].prompt.insert(requests[0].prompt.end(), {1, 2, 3});
  requests[1].prompt.insert(requests[1].prompt.end(), {4, 5});
  requests[1].arrival_step = 1;  // after the first has computed (and registered) the prefix
  for (auto& r : requests) {
    r.sampling.max_tokens = 5;
    r.sampling.ignore_eos = true;
  }
  cpu::BatchOptions options;
  options.record_logits = true;
  std::vector<std::vector<cpu::BatchResult>> runs;
  for (bool caching : {true, false}) {
    cpu::BatchSetup setup;
    setup.allocator_params = {{"block_size", std::int64_t{4}}, {"prefix_caching", caching}};
    setup.pool_slots = 256;
    cpu::BatchGenerator generator(checkpoint(), registry, setup);
    runs.push_back(generator.run(requests, options));
    const KvAllocatorStats stats = generator.allocator().stats();
    if (caching) {
      EXPECT_EQ(runs.back()[1].cached_prompt_tokens, 20);  // 5 full blocks of the shared prefix
      EXPECT_EQ(stats.prefix_hit_tokens, 20);
    } else {
      EXPECT_EQ(runs.back()[1].cached_prompt_tokens, 0);
      EXPECT_EQ(stats.prefix_hit_tokens, 0);
    }
  }
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(runs[0][i].tokens, runs[1][i].tokens);
    for (std::size_t t = 0; t < runs[0][i].logits.size(); ++t) {
      const auto c = test::compare(runs[0][i].logits[t], runs[1][i].logits[t]);
      EXPECT_FALSE(c.has_nan);
      EXPECT_LT(c.max_abs, 1e-4) << "request " << i << " token " << t;
    }
  }
  expect_matches_reference(checkpoint(), std::nullopt, requests, runs[0]);
}

TEST(BatchGeneration, SlidingWindowOnPagedReleasesBlocks) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  cpu::BatchSetup setup;
  setup.allocator_params = {{"block_size", std::int64_t{4}}};
  setup.attention = "sliding_window";
  setup.attention_params = {{"window", std::int64_t{8}}};
  setup.pool_slots = 24;  // 6 blocks: 40 tokens fit only because old blocks are released
  cpu::BatchGenerator generator(checkpoint(), registry, setup);
  std::vector<BatchRequest> requests(1);
  for (int t = 0; t < 10; ++t) requests[0].prompt.push_back(3 * t + 1);
  requests[0].sampling.max_tokens = 30;
  requests[0].sampling.ignore_eos = true;
  cpu::BatchOptions options;
  options.record_logits = true;
  const auto results = generator.run(requests, options);
  expect_matches_reference(generator.weights(), 8, requests, results);
}

TEST(BatchGeneration, ABrokenAllocatorIsCaught) {
  // A plugin built only for this test gives every sequence the same slots. With one sequence it
  // is harmless; with several, KV is overwritten and the reference comparison must fail.
  PluginRegistry registry({KVLAB_PLUGIN_DIR});
  registry.load_file(std::filesystem::path(KVLAB_TEST_PLUGIN_DIR) /
                     "kvlab_plugin_test_broken_allocator.so");
  cpu::BatchSetup setup;
  setup.allocator = "broken_shared_slots";
  setup.pool_slots = 256;
  cpu::BatchGenerator generator(checkpoint(), registry, setup);
  cpu::BatchOptions options;
  options.record_logits = true;
  const auto requests = make_requests(7);
  const auto results = generator.run(requests, options);
  const cpu::ReferenceModel reference(generator.weights());
  int mismatches = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    std::vector<std::int32_t> sequence = requests[i].prompt;
    cpu::ForwardOptions last;
    last.last_position_only = true;
    const cpu::RowMatrix expected = reference.forward(sequence, last);
    const auto c = test::compare(
        results[i].logits[0],
        std::span<const float>(expected.data(), static_cast<std::size_t>(expected.cols())));
    if (c.max_abs > 1e-4) ++mismatches;
  }
  EXPECT_GT(mismatches, 0);
}

TEST(BatchGeneration, ARequestThatCannotFitIsAClearError) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  cpu::BatchSetup setup;
  setup.allocator_params = {{"block_size", std::int64_t{4}}};
  setup.pool_slots = 8;
  cpu::BatchGenerator generator(checkpoint(), registry, setup);
  std::vector<BatchRequest> requests(1);
  requests[0].prompt.assign(12, 5);
  const std::string message = test::error_of<Error>([&] { generator.run(requests); });
  EXPECT_NE(message.find(
                "request 0: prompt 12 + max tokens 16 need more KV than the pool holds (8 slots)"),
            std::string::npos)
      << message;
}

TEST(BatchGeneration, VariantThatCannotRunTheModel) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  cpu::BatchSetup setup;
  setup.attention = "gqa";
  setup.attention_params = {{"group_size", std::int64_t{3}}};  // 4 query heads
  const std::string message =
      test::error_of<Error>([&] { cpu::BatchGenerator(checkpoint(), registry, setup); });
  EXPECT_NE(message.find("group_size 3 does not divide the 4 query heads"), std::string::npos)
      << message;
}

TEST(ConvertKvHeads, MeanPoolsGroupsAndRepeatsHeads) {
  const cpu::LlamaWeights& w = checkpoint();  // 2 KV heads of 16 dims
  const cpu::LlamaWeights mqa = cpu::convert_kv_heads(w, 1);
  EXPECT_EQ(mqa.config.num_key_value_heads, 1);
  const cpu::RowMatrix expected_k =
      (w.layers[0].wk().topRows(16) + w.layers[0].wk().bottomRows(16)) / 2.0f;
  EXPECT_LT((mqa.layers[0].wk() - expected_k).cwiseAbs().maxCoeff(), 1e-6);
  EXPECT_EQ(mqa.layers[0].wq(), w.layers[0].wq());
  const cpu::LlamaWeights mha = cpu::convert_kv_heads(w, 4);
  EXPECT_EQ(mha.layers[1].wv().middleRows(16, 16),
            w.layers[1].wv().topRows(16));  // head 1 repeats head 0
  EXPECT_EQ(mha.layers[1].wv().bottomRows(16), w.layers[1].wv().bottomRows(16));
  // Repeating heads computes exactly the same function.
  const std::vector<std::int32_t> tokens{1, 2, 3, 4, 5};
  const cpu::RowMatrix a = cpu::ReferenceModel(w).forward(tokens),
                       b = cpu::ReferenceModel(mha).forward(tokens);
  EXPECT_LT((a - b).cwiseAbs().maxCoeff(), 1e-4);
  EXPECT_NE(test::error_of<Error>([&] { cpu::convert_kv_heads(w, 3); }).find("cannot convert"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab
