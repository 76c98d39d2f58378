// kvlab check --tolerance's logit measures: top tokens, the agreement sums, the engine's log.
#include <gtest/gtest.h>

#include <vector>

#include "engine_logit_log.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/logit_agreement.hpp"

namespace kvlab {
namespace {

TEST(TopTokens, LargestFirstLowerIdFirstAmongEquals) {
  const std::vector<float> row = {0.5f, 3.0f, -1.0f, 3.0f, 2.0f, 7.0f, 2.0f, 0.0f, 2.0f};
  EXPECT_EQ(top_tokens(row), (TopTokens{5, 1, 3, 4, 6}));
  const std::vector<float> falling = {5, 4, 3, 2, 1};
  EXPECT_EQ(top_tokens(falling), (TopTokens{0, 1, 2, 3, 4}));
  const std::vector<float> flat(40, 1.0f);
  EXPECT_EQ(top_tokens(flat), (TopTokens{0, 1, 2, 3, 4}));
  const std::vector<float> last_wins = {0, 0, 0, 0, 0, 0, 0, 9};
  EXPECT_EQ(top_tokens(last_wins)[0], 7);
  EXPECT_THROW((void)top_tokens(std::vector<float>(4, 0.0f)), Error);
}

TEST(LogitAgreement, MeasuresRowsAndTopSets) {
  LogitAgreement a;
  EXPECT_EQ(a.top_overlap(), 1.0);  // nothing compared
  EXPECT_EQ(a.mean_row_max_delta(), 0.0);
  const std::vector<float> reference = {1, 2, 3, 4, 5, 6};
  const std::vector<float> engine = {1, 2.25f, 3, 4, 4.5f, 6};
  a.add_row(engine, reference);
  a.add_row(reference, reference);
  EXPECT_EQ(a.rows, 2);
  EXPECT_DOUBLE_EQ(a.max_abs_delta, 0.5);
  EXPECT_DOUBLE_EQ(a.mean_row_max_delta(), 0.25);
  EXPECT_THROW(a.add_row(std::vector<float>(5), reference), Error);
  a.add_top({1, 2, 3, 4, 5}, {5, 4, 3, 2, 1});  // same set, another order: 5 shared
  a.add_top({1, 2, 3, 4, 5}, {6, 7, 8, 9, 1});  // 1 shared
  EXPECT_EQ(a.top_shared, 6);
  EXPECT_DOUBLE_EQ(a.top_overlap(), 0.6);
}

// Rows are kept while the budget lasts, and only while every earlier row of the request was:
// a request's kept rows are always its first ones. Top tokens are kept for every row.
TEST(EngineLogitLog, KeepsEachRequestsFirstRowsWithinTheBudget) {
  constexpr std::int64_t kVocab = 6;
  EngineLogitLog log(kVocab, 3 * kVocab * sizeof(float));  // room for 3 rows
  auto row = [](float peak_at) {
    std::vector<float> r(kVocab, 0.0f);
    r[static_cast<std::size_t>(peak_at)] = 1.0f;
    return r;
  };
  log.record(0, 7, row(1));  // kept
  log.record(0, 8, row(2));  // kept
  log.record(1, 7, row(3));  // kept: another replica's request 7
  log.record(0, 7, row(4));  // budget spent: top tokens only
  log.record(0, 9, row(5));
  const auto& a = log.request(0, 7);
  ASSERT_EQ(a.top.size(), 2u);
  EXPECT_EQ(a.top[0][0], 1);
  EXPECT_EQ(a.top[1][0], 4);
  EXPECT_EQ(a.kept_rows(kVocab), 1u);
  EXPECT_EQ(a.rows[1], 1.0f);
  EXPECT_EQ(log.request(1, 7).kept_rows(kVocab), 1u);
  EXPECT_EQ(log.request(1, 7).top[0][0], 3);
  EXPECT_EQ(log.request(0, 9).kept_rows(kVocab), 0u);
  EXPECT_TRUE(log.request(2, 0).top.empty());  // never recorded
  EXPECT_THROW(log.record(0, 1, std::vector<float>(kVocab + 1)), Error);
  EXPECT_THROW(EngineLogitLog(4, 1024), Error);  // no top 5 in 4 tokens
}

}  // namespace
}  // namespace kvlab
