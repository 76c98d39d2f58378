// kvlab check of workload.logprobs: the engine's log-probabilities against the reference's, one
// position at a time (LogprobAgreement::add), and the tolerance it applies.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kvlab/experiment/logprob_agreement.hpp"

namespace kvlab {
namespace {

// A reference position over a 40-token vocabulary: token i has logit -0.1 i (tokens 0..39),
// so its top kMaxLogprobs are 0..19, most likely first.
GeneratedLogprobs reference_position(std::int32_t chosen) {
  std::vector<float> logits(40);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = -0.1f * static_cast<float>(i);
  return generated_logprobs(logits, chosen, kMaxLogprobs);
}

// What an engine reports for the same position, k alternatives, each value moved by `delta`.
GeneratedLogprobs engine_position(const GeneratedLogprobs& reference, std::size_t k,
                                  float delta = 0) {
  GeneratedLogprobs e{reference.logprob + delta, {}};
  for (std::size_t i = 0; i < k; ++i)
    e.top.push_back({reference.top[i].token, reference.top[i].logprob + delta});
  return e;
}

TEST(LogprobTolerance, ExactIsOneThousandthAndATauAboveItWins) {
  EXPECT_EQ(logprob_tolerance(0), 1e-3);
  EXPECT_EQ(logprob_tolerance(1e-4), 1e-3);
  EXPECT_EQ(logprob_tolerance(0.03), 0.03);
}

TEST(LogprobAgreement, CountsAndMeasuresWhatAgrees) {
  const GeneratedLogprobs reference = reference_position(0);
  ASSERT_EQ(reference.top.size(), static_cast<std::size_t>(kMaxLogprobs));
  LogprobAgreement a;
  EXPECT_EQ(a.add(engine_position(reference, 5, 4e-4f), reference, 1e-3), "");
  EXPECT_EQ(a.add(engine_position(reference, 0), reference, 1e-3), "");  // logprobs = 0
  EXPECT_EQ(a.tokens, 2);
  EXPECT_EQ(a.entries, 5);
  EXPECT_NEAR(a.max_abs_delta, 4e-4, 1e-6);
  LogprobAgreement b;
  b.tokens = 3;
  b.entries = 7;
  b.max_abs_delta = 0.5;
  a.merge(b);
  EXPECT_EQ(a.tokens, 5);
  EXPECT_EQ(a.entries, 12);
  EXPECT_EQ(a.max_abs_delta, 0.5);
}

TEST(LogprobAgreement, NamesAValueBeyondTheTolerance) {
  const GeneratedLogprobs reference = reference_position(2);
  LogprobAgreement a;
  GeneratedLogprobs chosen_off = engine_position(reference, 3);
  chosen_off.logprob -= 0.01f;
  EXPECT_NE(a.add(chosen_off, reference, 1e-3).find("its log-probability is"), std::string::npos);
  EXPECT_EQ(a.add(chosen_off, reference, 0.03), "");  // within a bf16 check's TAU
  GeneratedLogprobs top_off = engine_position(reference, 3);
  top_off.top[1].logprob += 0.01f;
  EXPECT_NE(a.add(top_off, reference, 1e-3).find("top 2: token 1 has"), std::string::npos);
  GeneratedLogprobs not_a_number = engine_position(reference, 1);
  not_a_number.logprob = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(a.add(not_a_number, reference, 1e9), "");
  EXPECT_TRUE(std::isfinite(a.max_abs_delta));
}

TEST(LogprobAgreement, TopListsMayDifferOnlyInTies) {
  const GeneratedLogprobs reference = reference_position(0);
  LogprobAgreement a;
  // The engine's 2nd and 3rd swapped: 0.1 apart in the reference, a real difference...
  GeneratedLogprobs swapped = engine_position(reference, 3);
  std::swap(swapped.top[1].token, swapped.top[2].token);
  EXPECT_NE(a.add(swapped, reference, 1e-3), "");
  // ...but within a tolerance of 0.2 the two are tied, and either order passes.
  EXPECT_EQ(a.add(swapped, reference, 0.2), "");
  // A token the reference ranks below its 20th listed in the engine's top 3.
  GeneratedLogprobs stranger = engine_position(reference, 3);
  stranger.top[2] = {30, reference.top[2].logprob};
  EXPECT_NE(a.add(stranger, reference, 1e-3).find("top 3: token 30"), std::string::npos);
  // The reference's 2nd is missing from the engine's top 3, its 4th in its place.
  GeneratedLogprobs missing = engine_position(reference, 4);
  missing.top.erase(missing.top.begin() + 1);
  EXPECT_NE(a.add(missing, reference, 1e-3).find("the reference's token 1"), std::string::npos);
}

}  // namespace
}  // namespace kvlab
