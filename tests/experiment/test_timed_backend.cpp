// The backend every run wraps its own in passes the token choices and the forward's result
// through (a run's cuda backend picked no token on the device while the wrapper dropped them)
// and counts the forwards whose tokens came back picked; its counters are the inner backend's.
#include <gtest/gtest.h>

#include <vector>

#include "timed_backend.hpp"

namespace kvlab {
namespace {

// Returns logits (4 per entry), or, for a forward given choices it accepts, one token per entry.
class PickingBackend final : public Backend {
 public:
  explicit PickingBackend(bool accepts) : accepts_(accepts) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    chosen_.clear();
    logprobs_.clear();
    if (accepts_ && !choices.empty()) {
      for (const TokenChoice& c : choices) chosen_.push_back(c.top_k);  // a token it can check
      for (const TokenChoice& c : choices) logprobs_.push_back({c.top_k, -0.25f * c.logprobs});
      return ForwardResult::of_tokens(chosen_, logprobs_, 1);
    }
    logits_.assign(batch.size() * 4, 0.5f);
    return ForwardResult::of_logits(logits_);
  }
  std::int64_t vocab_size() const override { return 4; }
  BackendCounters counters() const override { return {2, 5}; }

 private:
  bool accepts_;
  std::vector<float> logits_;
  std::vector<std::int32_t> chosen_;
  std::vector<TokenLogprob> logprobs_;
};

TEST(TimedBackend, PassesTokenChoicesThroughAndCountsTheForwardsThatPicked) {
  PickingBackend inner(true);
  TimedBackend timed(inner);
  const std::vector<BatchEntry> batch(2);
  const ForwardResult logits = timed.forward(batch, {});
  EXPECT_EQ(logits.logits.size(), 8u);  // not asked: logits
  EXPECT_TRUE(logits.tokens.empty());
  TokenChoice first, second;
  first.top_k = 3;
  second.top_k = 1;
  second.logprobs = 2;
  const std::vector<TokenChoice> choices = {first, second};
  const ForwardResult picked = timed.forward(batch, choices);
  EXPECT_TRUE(picked.logits.empty());
  EXPECT_EQ(std::vector<std::int32_t>(picked.tokens.begin(), picked.tokens.end()),
            (std::vector<std::int32_t>{3, 1}));
  ASSERT_EQ(picked.logprobs.size(), 2u);  // the inner backend's, passed through
  EXPECT_EQ(picked.logprobs[1].logprob, -0.5f);
  EXPECT_EQ(picked.logprob_width, 1u);
  EXPECT_EQ(timed.forwards(), 2);
  EXPECT_EQ(timed.forwards_with_chosen_tokens(), 1);
  EXPECT_GE(timed.seconds(), 0.0);
  EXPECT_EQ(timed.counters().graph_captures, 2);  // the inner backend's, passed through
  EXPECT_EQ(timed.counters().graph_replays, 5);

  PickingBackend declining(false);
  TimedBackend timed_declining(declining);
  EXPECT_EQ(timed_declining.forward(batch, choices).logits.size(), 8u);
  EXPECT_EQ(timed_declining.forwards_with_chosen_tokens(), 0);
}

}  // namespace
}  // namespace kvlab
