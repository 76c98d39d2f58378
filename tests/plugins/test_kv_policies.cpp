// The shipped KV policies (plugins/kv_policies/): which positions each keeps under its budget.
// window keeps the newest; streaming_llm the first `sinks` and the newest; h2o the newest and
// those with the most attention accumulated over forwards; snapkv the observation window and
// the positions its (max-pooled) votes favour. Every policy keeps everything while it fits,
// returns increasing positions it was given, and refuses parameters that leave no room.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab {
namespace {

PluginObject<KvPolicy> kv_policy(const char* name,
                                 const std::map<std::string, ParamValue, std::less<>>& params) {
  static const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  return registry.create<PluginKind::kv_policy>(name, params, PluginContext{});
}

std::vector<std::int64_t> range(std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

std::vector<std::int64_t> select(KvPolicy& policy, std::int64_t sequence,
                                 const std::vector<std::int64_t>& positions,
                                 const std::vector<float>& scores = {},
                                 std::int64_t new_tokens = 1) {
  std::vector<std::int64_t> kept(positions.size());
  const std::int64_t n = policy.select({sequence, positions, scores, new_tokens, false}, kept);
  kept.resize(static_cast<std::size_t>(n));
  return kept;
}

TEST(KvPolicies, WindowKeepsTheNewestAndEverythingWhileItFits) {
  auto window = kv_policy("window", {{"budget", std::int64_t{4}}});
  EXPECT_EQ(window->budget(), 4);
  EXPECT_EQ(window->scored_queries(), 0);
  EXPECT_EQ(select(*window, 0, range(0, 3)), range(0, 3));
  EXPECT_EQ(select(*window, 0, range(0, 9)), range(5, 9));
}

TEST(KvPolicies, StreamingLlmKeepsTheSinksAndTheNewest) {
  auto streaming =
      kv_policy("streaming_llm", {{"budget", std::int64_t{6}}, {"sinks", std::int64_t{2}}});
  EXPECT_EQ(select(*streaming, 0, range(0, 6)), range(0, 6));
  EXPECT_EQ(select(*streaming, 0, range(0, 20)), (std::vector<std::int64_t>{0, 1, 16, 17, 18, 19}));
  // Held positions after earlier selections: the sinks are whichever come first.
  EXPECT_EQ(select(*streaming, 0, {0, 1, 16, 17, 18, 19, 20}),
            (std::vector<std::int64_t>{0, 1, 17, 18, 19, 20}));
  EXPECT_THROW(
      kv_policy("streaming_llm", {{"budget", std::int64_t{4}}, {"sinks", std::int64_t{4}}}),
      std::exception);
}

TEST(KvPolicies, H2oKeepsTheNewestAndTheMostAttendedOverForwards) {
  auto h2o = kv_policy("h2o", {{"budget", std::int64_t{4}}, {"recent_share", 0.5}});
  EXPECT_GT(h2o->scored_queries(), 1000);  // every query of a forward
  // Forward 1: positions 0-4; 1 and 3 draw the attention. Over budget: keep 3, 4 (newest) and
  // the best two of 0-2 by accumulated score: 1, then 0 over 2 on a tie (the older).
  EXPECT_EQ(select(*h2o, 7, range(0, 5), {0.0f, 2.0f, 0.0f, 5.0f, 1.0f}, 5),
            (std::vector<std::int64_t>{0, 1, 3, 4}));
  // Forward 2 adds 5; now 0 gets more this time, but 1's sum (2 + 0.5) still beats it.
  EXPECT_EQ(select(*h2o, 7, {0, 1, 3, 4, 5}, {1.0f, 0.5f, 0.0f, 0.0f, 0.0f}),
            (std::vector<std::int64_t>{1, 3, 4, 5}));
  // Forward 3 adds 6: 3's early 5.0 outweighs 1's 2.5; 5 and 6 are the newest.
  EXPECT_EQ(select(*h2o, 7, {1, 3, 4, 5, 6}, {0, 0, 0, 0, 0}),
            (std::vector<std::int64_t>{1, 3, 5, 6}));
  h2o->forget(7);  // a new sequence with the same id starts from nothing
  EXPECT_EQ(select(*h2o, 7, range(0, 5), {0.0f, 0.0f, 3.0f, 0.0f, 0.0f}, 5),
            (std::vector<std::int64_t>{0, 2, 3, 4}));
}

TEST(KvPolicies, SnapKvKeepsTheWindowAndWhatItVotesFor) {
  auto snap = kv_policy(
      "snapkv",
      {{"budget", std::int64_t{5}}, {"window", std::int64_t{2}}, {"kernel", std::int64_t{1}}});
  EXPECT_EQ(snap->scored_queries(), 2);
  std::vector<float> votes(10, 0.0f);
  votes[3] = 4;
  votes[7] = 2;
  votes[1] = 1;
  EXPECT_EQ(select(*snap, 0, range(0, 10), votes, 10), (std::vector<std::int64_t>{1, 3, 7, 8, 9}));
  auto pooled = kv_policy(
      "snapkv",
      {{"budget", std::int64_t{5}}, {"window", std::int64_t{2}}, {"kernel", std::int64_t{3}}});
  // Pooling over 3 spreads 3's vote to 2 and 4: they outrank 7.
  EXPECT_EQ(select(*pooled, 0, range(0, 10), votes, 10),
            (std::vector<std::int64_t>{2, 3, 4, 8, 9}));
  EXPECT_THROW(kv_policy("snapkv", {{"budget", std::int64_t{4}}, {"window", std::int64_t{4}}}),
               std::exception);
}

TEST(KvSelection, KeepsEndsAndTopAndMaxPools) {
  const std::vector<std::int64_t> positions = {0, 2, 3, 5, 8, 9};
  const std::vector<double> scores = {9, 1, 7, 7, 0, 0};
  std::vector<std::int64_t> kept(positions.size());
  // first 1, recent 2, top 1 of {2, 3, 5}: 3 and 5 tie at 7, the older (3) wins.
  ASSERT_EQ(keep_ends_and_top(positions, scores, 1, 2, 1, kept), 4);
  EXPECT_EQ(std::vector<std::int64_t>(kept.begin(), kept.begin() + 4),
            (std::vector<std::int64_t>{0, 3, 8, 9}));
  EXPECT_EQ(keep_ends_and_top(positions, scores, 4, 4, 4, kept), 6);  // all fit
  std::vector<double> values = {0, 5, 0, 0, 1};
  max_pool(values, 3);
  EXPECT_EQ(values, (std::vector<double>{5, 5, 5, 1, 1}));
}

}  // namespace
}  // namespace kvlab
