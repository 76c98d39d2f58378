// The shipped KV policies (plugins/kv_policies/): which positions each keeps under its budget.
// window keeps the newest; streaming_llm the first `sinks` and the newest; h2o the newest and
// those with the most attention accumulated over forwards; snapkv the observation window and
// the positions its (max-pooled) votes favour; in each layer's K/V head where the paper selects
// per head (h2o, snapkv), with budgets that shrink with depth (pyramidkv) or that a layer's heads
// share (adakv). Every policy keeps everything while it fits and refuses parameters that leave
// no room.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kvlab/kv/kv_keep.hpp"
#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "test_util.hpp"

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

// What each (layer, K/V head) keeps of `positions`, row layer * kv_heads + head; `scores`:
// (layers, kv_heads, positions). Checks the count the policy returns.
std::vector<std::vector<std::int64_t>> select_heads(KvPolicy& policy, std::int64_t sequence,
                                                    const std::vector<std::int64_t>& positions,
                                                    const std::vector<float>& scores,
                                                    std::int64_t layers, std::int64_t kv_heads,
                                                    std::int64_t new_tokens = 1,
                                                    bool prompt_done = false) {
  const auto n = static_cast<std::int64_t>(positions.size());
  std::vector<std::uint8_t> cells(static_cast<std::size_t>(layers * kv_heads * n), 0);
  const KvKeep keep{cells, layers, kv_heads, n};
  const std::int64_t marked = policy.select(
      {sequence, positions, scores, {}, layers, kv_heads, new_tokens, prompt_done}, keep);
  std::vector<std::vector<std::int64_t>> kept(static_cast<std::size_t>(layers * kv_heads));
  std::int64_t counted = 0;
  for (std::int64_t row = 0; row < layers * kv_heads; ++row)
    for (std::int64_t i = 0; i < n; ++i)
      if (cells[static_cast<std::size_t>(row * n + i)] != 0) {
        kept[static_cast<std::size_t>(row)].push_back(positions[static_cast<std::size_t>(i)]);
        ++counted;
      }
  EXPECT_EQ(marked, counted);
  return kept;
}

// One layer, one K/V head: the positions it keeps.
std::vector<std::int64_t> select(KvPolicy& policy, std::int64_t sequence,
                                 const std::vector<std::int64_t>& positions,
                                 const std::vector<float>& scores = {},
                                 std::int64_t new_tokens = 1) {
  return select_heads(policy, sequence, positions, scores, 1, 1, new_tokens).front();
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

using Kept = std::vector<std::vector<std::int64_t>>;

// H2O per head (its paper): each K/V head keeps its own heavy hitters beside the shared recent
// ones; per_head = false sums the heads' scores and keeps one set everywhere.
TEST(KvPolicies, H2oSelectsPerHeadUnlessAskedToPoolTheHeads) {
  auto h2o = kv_policy("h2o", {{"budget", std::int64_t{3}}, {"recent_share", 1.0 / 3}});
  EXPECT_GT(h2o->held_limit(), h2o->budget());  // the heads' union is not bounded by it
  //                             head 0: 0 and 2 heavy      head 1: 1 and 3 heavy
  const std::vector<float> scores = {5, 0, 4, 0, 0, 0, 0, 6, 0, 3, 0, 0};
  EXPECT_EQ(select_heads(*h2o, 1, range(0, 6), scores, 1, 2, 6), (Kept{{0, 2, 5}, {1, 3, 5}}));
  auto pooled = kv_policy(
      "h2o", {{"budget", std::int64_t{3}}, {"recent_share", 1.0 / 3}, {"per_head", false}});
  EXPECT_EQ(pooled->held_limit(), 3);
  EXPECT_EQ(select_heads(*pooled, 1, range(0, 6), scores, 1, 2, 6),  // sums 5 6 4 3 0 0
            (Kept{{0, 1, 5}, {0, 1, 5}}));
}

// SnapKV per layer (and head): each votes with its own window's attention. One shot (the paper's
// protocol): nothing is dropped before the forward that ends the prompt, nothing after it.
TEST(KvPolicies, SnapKvVotesPerLayerAndCompressesThePromptOnceWhenOneShot) {
  const std::map<std::string, ParamValue, std::less<>> params = {
      {"budget", std::int64_t{4}}, {"window", std::int64_t{2}}, {"kernel", std::int64_t{1}}};
  std::vector<float> scores(16, 0.0f);  // (2 layers, 1 head, 8 positions)
  scores[1] = scores[2] = 1;            // layer 0 looks at 1 and 2
  scores[8 + 4] = scores[8 + 5] = 1;    // layer 1 at 4 and 5
  auto snap = kv_policy("snapkv", params);
  EXPECT_EQ(select_heads(*snap, 0, range(0, 8), scores, 2, 1, 8),
            (Kept{{1, 2, 6, 7}, {4, 5, 6, 7}}));
  auto params_once = params;
  params_once["one_shot"] = true;
  auto once = kv_policy("snapkv", params_once);
  EXPECT_EQ(select_heads(*once, 0, range(0, 8), scores, 2, 1, 4, false),
            (Kept{range(0, 8), range(0, 8)}));  // a prompt chunk: kept whole
  EXPECT_EQ(select_heads(*once, 0, range(0, 8), scores, 2, 1, 4, true),
            (Kept{{1, 2, 6, 7}, {4, 5, 6, 7}}));  // the prompt's end: compressed
  const std::vector<std::int64_t> decoded = {1, 2, 4, 5, 6, 7, 8};
  EXPECT_EQ(select_heads(*once, 0, decoded, std::vector<float>(14, 0.0f), 2, 1, 1, false),
            (Kept{decoded, decoded}));  // generated tokens: every one kept
}

// PyramidKV: SnapKV under budgets on a line from 2s - s/beta (first layer) to s/beta (last),
// s = budget - window, the window besides: here 17, 12, 7 for budget 12, averaging the budget.
TEST(KvPolicies, PyramidKvKeepsMoreInLowerLayersAndTheBudgetOnAverage) {
  auto pyramid = kv_policy("pyramidkv", {{"budget", std::int64_t{12}},
                                         {"window", std::int64_t{2}},
                                         {"kernel", std::int64_t{1}},
                                         {"beta", 2.0}});
  std::vector<float> scores(3 * 20);
  for (std::size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i % 7);
  const Kept kept = select_heads(*pyramid, 0, range(0, 20), scores, 3, 1, 20);
  EXPECT_EQ(kept[0].size(), 17u);
  EXPECT_EQ(kept[1].size(), 12u);
  EXPECT_EQ(kept[2].size(), 7u);
  for (const auto& layer : kept) EXPECT_EQ(layer.back(), 19);  // the window in every layer
  // 10 positions: the two lower layers hold them all, the top one is already over its 7.
  const Kept short_one =
      select_heads(*pyramid, 1, range(0, 10), std::vector<float>(30, 1.0f), 3, 1, 10);
  EXPECT_EQ(short_one[0].size(), 10u);
  EXPECT_EQ(short_one[1].size(), 10u);
  EXPECT_EQ(short_one[2].size(), 7u);
}

// Ada-KV: a layer's budget x heads is shared. A head whose attention is on one position keeps it
// and the window; the head whose attention is spread takes the cells the other does not need,
// beyond an even split. Each head keeps its window and its floor share first.
TEST(KvPolicies, AdaKvSharesALayersBudgetBetweenItsHeads) {
  auto ada = kv_policy("adakv", {{"budget", std::int64_t{5}},
                                 {"window", std::int64_t{1}},
                                 {"kernel", std::int64_t{1}},
                                 {"floor", 0.25}});
  std::vector<float> scores(20, 0.0f);  // (1 layer, 2 heads, 10 positions)
  scores[0] = 9;                        // head 0: all on position 0
  for (int i = 0; i < 10; ++i) scores[10 + static_cast<std::size_t>(i)] = static_cast<float>(i);
  const Kept kept = select_heads(*ada, 0, range(0, 10), scores, 1, 2, 10);
  EXPECT_EQ(kept, (Kept{{0, 9}, {2, 3, 4, 5, 6, 7, 8, 9}}));  // 10 cells: 5 a head on average
  auto snap = kv_policy(
      "snapkv",
      {{"budget", std::int64_t{5}}, {"window", std::int64_t{1}}, {"kernel", std::int64_t{1}}});
  EXPECT_EQ(select_heads(*snap, 0, range(0, 10), scores, 1, 2, 10),  // an even split
            (Kept{{0, 1, 2, 3, 9}, {5, 6, 7, 8, 9}}));
}

// The owner's side (kvlab/kv/kv_keep.hpp): the union of the heads' choices is what stays in the
// slots, each head masked to its own; a head cannot bring back what it dropped; a choice that
// breaks the policy's promises is refused; a view's key mask marks new positions visible.
TEST(KvKeep, TheUnionStaysEachHeadIsMaskedAndWhatAHeadDroppedStaysDropped) {
  auto snap = kv_policy(
      "snapkv",
      {{"budget", std::int64_t{3}}, {"window", std::int64_t{1}}, {"kernel", std::int64_t{1}}});
  const std::vector<std::int64_t> positions = {0, 2, 3, 5, 8};
  //                               head 0 sees all; head 1 dropped 3 before
  const std::vector<std::uint8_t> visible = {1, 1, 1, 1, 1, 1, 1, 0, 1, 1};
  const std::vector<float> scores = {0, 4, 3, 0, 0, 0, 1, 9, 2, 0};  // head 1 would pick 3
  std::vector<std::uint8_t> cells(10, 0);
  const KvKeep keep{cells, 1, 2, 5};
  const KvPolicyStep step{4, positions, scores, visible, 1, 2, 1, false};
  const HeadSelection kept = kept_by_policy(*snap, "snapkv", step, keep, snap->select(step, keep));
  EXPECT_EQ(kept.positions, (std::vector<std::int64_t>{2, 3, 5, 8}));  // the union
  EXPECT_EQ(kept.visible, (std::vector<std::uint8_t>{1, 1, 0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(kept.cells, 6);        // head 1: 5 (its best it still sees) and 2, window 8
  std::vector<std::uint8_t> mask;  // a view of the union and a new position 9
  key_mask_for(kept, std::vector<std::int64_t>{2, 3, 5, 8, 9}, 9, mask);
  EXPECT_EQ(mask, (std::vector<std::uint8_t>{1, 1, 0, 1, 1, 1, 0, 1, 1, 1}));
  // A head's mark on what it dropped is undone (head 1 marks 3: it keeps 2 positions, not 3).
  std::fill(cells.begin(), cells.end(), std::uint8_t{0});
  for (const std::size_t i : {1, 2, 4, 6, 7, 9}) cells[i] = 1;
  const HeadSelection undone = kept_by_policy(*snap, "snapkv", step, keep, 6);
  EXPECT_EQ(undone.cells, 5);
  std::fill(cells.begin(), cells.end(), std::uint8_t{1});  // keeping all it sees is allowed
  EXPECT_EQ(kept_by_policy(*snap, "snapkv", step, keep, 10).cells, 9);
  std::fill(cells.begin(), cells.end(), std::uint8_t{1});  // (the owner undid a mark in place)
  cells[0] = 0;  // dropping one of them and keeping 8 cells is over 3 a head
  test::expect_error_containing([&] { (void)kept_by_policy(*snap, "snapkv", step, keep, 9); },
                                {"KV policy \"snapkv\" kept 9", "budget 3"});
}

// A layer's window hides what it has passed from its heads (the next query, at newest + 1, sees
// from newest + 2 - W on), the other layers untouched; and each KV group keeps the union of its
// own layers' heads, group 0 the union over every layer.
TEST(KvKeep, AWindowHidesWhatItPassedAndEachGroupKeepsItsOwnLayersChoice) {
  const std::vector<std::optional<std::int64_t>> windows = {std::nullopt, 4, 4};
  const std::vector<std::int64_t> positions = {0, 2, 5, 6, 7, 8};  // newest 8: layer 1 sees 6-8
  std::vector<std::uint8_t> visible;
  hide_outside_windows(windows, 2, positions, visible);
  const std::vector<std::uint8_t> row_all(6, 1), row_window = {0, 0, 0, 1, 1, 1};
  ASSERT_EQ(visible.size(), 3u * 2 * 6);
  for (std::size_t row = 0; row < 6; ++row)
    EXPECT_EQ(std::vector<std::uint8_t>(visible.begin() + static_cast<long>(row * 6),
                                        visible.begin() + static_cast<long>(row * 6 + 6)),
              row < 2 ? row_all : row_window)
        << row;
  std::vector<std::uint8_t> none;  // nothing passed: nothing filled in
  hide_outside_windows(windows, 2, std::vector<std::int64_t>{6, 7, 8}, none);
  EXPECT_TRUE(none.empty());

  HeadSelection kept;  // layers 0 (group 0), 1 and 2 (group 1), one K/V head, 4 kept positions
  kept.positions = {0, 5, 7, 8};
  kept.layers = 3;
  kept.kv_heads = 1;
  kept.visible = {1, 1, 0, 1, /* layer 1 */ 0, 0, 1, 1, /* layer 2 */ 0, 1, 0, 1};
  const auto groups = kept_per_group(kept, std::vector<std::int64_t>{0, 1, 1}, 2);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], (std::vector<std::int64_t>{0, 5, 7, 8}));
  EXPECT_EQ(groups[1], (std::vector<std::int64_t>{5, 7, 8}));  // 0: only layer 0 keeps it
}

TEST(KvSelection, KeepsEndsAndTopAndMaxPools) {
  // positions {0, 2, 3, 5, 8, 9}
  const std::vector<double> scores = {9, 1, 7, 7, 0, 0};
  std::vector<std::uint8_t> mark(scores.size(), 0);
  // first 1, recent 2, top 1 of {2, 3, 5}: 3 and 5 tie at 7, the older (3) wins.
  ASSERT_EQ(mark_ends_and_top(scores, 1, 2, 1, mark), 4);
  EXPECT_EQ(mark, (std::vector<std::uint8_t>{1, 0, 1, 0, 1, 1}));  // positions 0, 3, 8, 9
  std::fill(mark.begin(), mark.end(), std::uint8_t{0});
  EXPECT_EQ(mark_ends_and_top(scores, 4, 4, 4, mark), 6);  // all fit
  std::vector<double> values = {0, 5, 0, 0, 1};
  max_pool(values, 3);
  EXPECT_EQ(values, (std::vector<double>{5, 5, 5, 1, 1}));
}

}  // namespace
}  // namespace kvlab
