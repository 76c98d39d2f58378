// The backend every run wraps its own in passes Backend::choose_tokens and chosen_logprobs
// through (a run's cuda backend picked no token on the device while the wrapper dropped it) and
// counts the forwards
// whose tokens came back picked; its counters are the inner backend's.
#include <gtest/gtest.h>

#include <vector>

#include "timed_backend.hpp"

namespace kvlab {
namespace {

// Returns logits (4 per entry), or, for a forward it was asked to pick for, one token per entry.
class PickingBackend final : public Backend {
 public:
  explicit PickingBackend(bool accepts) : accepts_(accepts) {}
  std::span<const float> forward(std::span<const BatchEntry> batch) override {
    chosen_.clear();
    for (const TokenChoice& c : asked_) chosen_.push_back(c.top_k);  // a token it can check
    logprobs_.clear();
    for (const TokenChoice& c : asked_) logprobs_.push_back({c.top_k, -0.25f * c.logprobs});
    const bool picked = !asked_.empty();
    asked_.clear();
    logits_.assign(batch.size() * 4, 0.5f);
    return picked ? std::span<const float>() : std::span<const float>(logits_);
  }
  std::int64_t vocab_size() const override { return 4; }
  std::span<const std::int32_t> chosen_tokens() const override { return chosen_; }
  std::span<const TokenLogprob> chosen_logprobs() const override { return logprobs_; }
  bool choose_tokens(std::span<const TokenChoice> choices) override {
    if (accepts_) asked_.assign(choices.begin(), choices.end());
    return accepts_;
  }
  BackendCounters counters() const override { return {2, 5}; }

 private:
  bool accepts_;
  std::vector<TokenChoice> asked_;
  std::vector<float> logits_;
  std::vector<std::int32_t> chosen_;
  std::vector<TokenLogprob> logprobs_;
};

TEST(TimedBackend, PassesTokenChoicesThroughAndCountsTheForwardsThatPicked) {
  PickingBackend inner(true);
  TimedBackend timed(inner);
  const std::vector<BatchEntry> batch(2);
  EXPECT_EQ(timed.forward(batch).size(), 8u);  // not asked: logits
  EXPECT_TRUE(timed.chosen_tokens().empty());
  TokenChoice first, second;
  first.top_k = 3;
  second.top_k = 1;
  second.logprobs = 2;
  const std::vector<TokenChoice> choices = {first, second};
  EXPECT_TRUE(timed.choose_tokens(choices));
  EXPECT_TRUE(timed.forward(batch).empty());
  EXPECT_EQ(std::vector<std::int32_t>(timed.chosen_tokens().begin(), timed.chosen_tokens().end()),
            (std::vector<std::int32_t>{3, 1}));
  ASSERT_EQ(timed.chosen_logprobs().size(), 2u);  // the inner backend's, passed through
  EXPECT_EQ(timed.chosen_logprobs()[1].logprob, -0.5f);
  EXPECT_EQ(timed.forwards(), 2);
  EXPECT_EQ(timed.forwards_with_chosen_tokens(), 1);
  EXPECT_GE(timed.seconds(), 0.0);
  EXPECT_EQ(timed.counters().graph_captures, 2);  // the inner backend's, passed through
  EXPECT_EQ(timed.counters().graph_replays, 5);

  PickingBackend declining(false);
  TimedBackend timed_declining(declining);
  EXPECT_FALSE(timed_declining.choose_tokens(choices));
  EXPECT_EQ(timed_declining.forward(batch).size(), 8u);
  EXPECT_EQ(timed_declining.forwards_with_chosen_tokens(), 0);
}

}  // namespace
}  // namespace kvlab
